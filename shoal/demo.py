"""`shoal demo`: the main job on the embedded default model.

1. A few chat questions.
2. A shared-prefix workload: one long document, several questions about it. The first
   request computes the document's KV; the others reuse its blocks from the prefix cache.
   The same questions, each under its own cache salt (so nothing is reused), check that
   reuse never changes an output.
"""

from __future__ import annotations

import statistics
import sys
import time

from shoal import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is the boiling point of water in Celsius?",
]

DOCUMENT = """Harbor Point Ferry Service: operating handbook for new deck crew.

The ferry Gull runs between Harbor Point and Lantern Island six times a day. The first
crossing leaves Harbor Point at 6:30 in the morning and the last one returns from Lantern
Island at 9:15 in the evening. A crossing takes forty minutes in calm water. The Gull
carries at most 180 passengers and 24 cars. Bicycles travel free; cars pay twelve dollars
each way and passengers pay four dollars. Children under five ride free.

Before every crossing the deck crew checks the life jackets, the two rescue boats and the
radio. The captain on weekdays is Maria Olsen; on weekends the captain is Tomas Reyes.
The chief engineer is Priya Nair, who has worked on the Gull for eleven years. If the wind
is stronger than forty knots, the captain cancels the crossing and the office posts a
notice on the board at the ticket window.

Passengers must board ten minutes before departure. Cars board first, then foot
passengers. Dogs are welcome on the open upper deck but must stay on a leash. The snack
bar on the lower deck sells coffee, tea, sandwiches and the famous Lantern Island apple
cake. The snack bar closes five minutes before the ferry docks.

Lost property is kept in the office at Harbor Point for thirty days. In an emergency the
crew sounds seven short blasts and one long blast on the horn, and passengers gather at
the muster station next to the stairs on the upper deck. Every new crew member completes
a safety drill in the first week and a first aid course in the first month.
"""

DOC_QUESTIONS = [
    "Who is the captain on weekends?",
    "How much does a car pay each way?",
    "When does the first crossing leave Harbor Point?",
    "Where do passengers gather in an emergency?",
]


def _doc_chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the handbook below.\n\n" + DOCUMENT},
            {"role": "user", "content": question}]


def run_demo(model: str = "smollm2", overlap: bool = True) -> int:
    out = sys.stdout
    t0 = time.perf_counter()
    with LLM(model, overlap_scheduler=overlap) as llm:
        print(f"Shoal demo: model {model} loaded in {time.perf_counter() - t0:.1f} s "
              f"({llm.engine.info.num_kv_blocks} KV blocks of {llm.config.block_size} tokens)\n",
              file=out)
        sampling = SamplingParams(max_tokens=48)
        for q, o in zip(QUESTIONS, llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                                            sampling)):
            print(f"Q: {q}\nA: {o.text.strip()}\n", file=out)

        doc_tokens = len(llm.tokenizer.apply_chat_template(_doc_chat("")))
        print(f"Shared-prefix workload: a {doc_tokens}-token handbook, {len(DOC_QUESTIONS)} "
              "questions.", file=out)
        short = SamplingParams(max_tokens=32)
        first = llm.chat([_doc_chat(DOC_QUESTIONS[0])], short)
        rest = llm.chat([_doc_chat(q) for q in DOC_QUESTIONS[1:]], short)
        reused = first + rest
        # Same questions, one at a time, each under its own cache salt: other block keys,
        # so nothing is reused and every request computes the whole handbook.
        recomputed = [llm.chat([_doc_chat(q)], short, cache_salt=f"no-reuse-{i}")[0]
                      for i, q in enumerate(DOC_QUESTIONS)]
        llm.check_integrity()
        stats = llm.stats()

    print(f"\n{'request':<52} {'TTFT s':>8} {'prefix reused':>14}", file=out)
    for q, o in zip(DOC_QUESTIONS, reused):
        print(f"{q:<52} {o.metrics.ttft_s:>8.3f} {o.num_local_prefix_tokens:>14}", file=out)
        print(f"    -> {o.text.strip()}", file=out)
    cold = first[0].metrics.ttft_s
    warm = statistics.mean(o.metrics.ttft_s for o in rest)
    recompute = statistics.mean(o.metrics.ttft_s for o in recomputed)
    identical = [o.token_ids for o in reused] == [o.token_ids for o in recomputed]
    print("\nSummary", file=out)
    print(f"  TTFT cold (first request, computes the handbook)   {cold:8.3f} s", file=out)
    print(f"  TTFT warm (mean of the others, prefix reused)      {warm:8.3f} s "
          f"({warm / cold:.2f} x cold)", file=out)
    print(f"  TTFT without reuse (one at a time, mean)           {recompute:8.3f} s", file=out)
    print(f"  tokens reused from the local prefix cache          "
          f"{sum(o.num_local_prefix_tokens for o in rest):8d}", file=out)
    print(f"  tokens loaded from the pool                        "
          f"{stats['connector_tokens_loaded']:8d}  (no pool in this version)", file=out)
    print(f"  outputs identical with and without reuse           "
          f"{'yes' if identical else 'NO'}", file=out)
    print(f"  engine: {stats['iterations']} iterations, {stats['forward_passes']} forward passes, "
          f"{stats['generated_tokens']} tokens generated", file=out)
    return 0 if identical else 1
