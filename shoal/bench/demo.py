"""`shoal demo`: the main job on the embedded default model.

1. A few chat questions.
2. A shared-prefix workload (one handbook, several questions about it) run cold on 2
   attention-data-parallel ranks with a KV pool, which compute the handbook and save its
   blocks, then on a fresh fleet on the same pool (as after a restart), whose owners
   load them. Outputs must be identical. A table per owner follows.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
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


DP_SIZE = 2  # attention-data-parallel owners sharing the pool


def run_demo(model: str = "smollm2", overlap: bool = True, pool_dir: str | None = None) -> int:
    """Chat answers, then the handbook workload cold (computes and saves to the pool) and in
    a fresh engine on the same pool (loads). Exit status 1 if the outputs differ."""
    if pool_dir is None:
        with tempfile.TemporaryDirectory(prefix="shoal-demo-pool-") as tmp:
            return _demo(model, overlap, tmp)
    return _demo(model, overlap, pool_dir)


def _demo(model: str, overlap: bool, pool_dir: str) -> int:
    out = sys.stdout
    short = SamplingParams(max_tokens=32)
    t0 = time.perf_counter()
    with LLM(model, kv_pool=pool_dir, overlap_scheduler=overlap, dp_size=DP_SIZE) as llm:
        print(f"Shoal demo: model {model}, {DP_SIZE} ADP ranks, up in "
              f"{time.perf_counter() - t0:.1f} s ({llm.engine.info.num_kv_blocks} KV blocks of "
              f"{llm.config.block_size} tokens per rank), KV pool {pool_dir}\n", file=out)
        chats = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                         SamplingParams(max_tokens=48))
        for q, o in zip(QUESTIONS, chats):
            print(f"Q: {q}\nA: {o.text.strip()}\n", file=out)
        doc_tokens = len(llm.tokenizer.apply_chat_template(_doc_chat("")))
        cold = llm.chat([_doc_chat(q) for q in DOC_QUESTIONS], short)
        cold_stats = llm.stats()
    # A fresh fleet (as after a restart) on the same pool: the handbook's blocks load.
    with LLM(model, kv_pool=pool_dir, overlap_scheduler=overlap, dp_size=DP_SIZE) as llm:
        warm = llm.chat([_doc_chat(q) for q in DOC_QUESTIONS], short)
        warm_stats = llm.stats()

    print(f"Shared-prefix workload: a {doc_tokens}-token handbook, {len(DOC_QUESTIONS)} "
          "questions, run cold, then in a fresh fleet on the same pool.\n", file=out)
    print(f"{'question':<50} {'TTFT cold':>10} {'TTFT warm':>10} {'loaded':>7}", file=out)
    for q, c, w in zip(DOC_QUESTIONS, cold, warm):
        print(f"{q:<50} {c.metrics.ttft_s:>9.3f}s {w.metrics.ttft_s:>9.3f}s "
              f"{w.num_connector_tokens:>7}", file=out)
        print(f"    -> {w.text.strip()}", file=out)
    ttft_cold = statistics.mean(o.metrics.ttft_s for o in cold)
    ttft_warm = statistics.mean(o.metrics.ttft_s for o in warm)
    identical = [o.token_ids for o in cold] == [o.token_ids for o in warm]
    print("\nSummary", file=out)
    print(f"  TTFT cold (computed, mean)                 {ttft_cold:8.3f} s", file=out)
    print(f"  TTFT warm (fresh fleet, pool, mean)        {ttft_warm:8.3f} s "
          f"({ttft_warm / ttft_cold:.2f} x cold)", file=out)
    print(f"  tokens loaded from the pool                {warm_stats['connector_tokens_loaded']:8d}"
          f"  ({warm_stats['bytes_loaded'] / 2**20:.1f} MiB, "
          f"{warm_stats['pool_hit_blocks']} block hits)", file=out)
    print(f"  blocks saved by the cold run               {cold_stats['blocks_saved']:8d}", file=out)
    print(f"  outputs identical cold vs warm             "
          f"{'yes' if identical else 'NO'}", file=out)
    print(f"\n{'owner':<8}{'prompt tokens':>14}{'saved (cold)':>14}{'loaded (warm)':>15}"
          f"{'pool hits':>11}{'steps':>8}{'control/step':>14}", file=out)
    for rank, (c, w) in enumerate(zip(cold_stats["per_rank"], warm_stats["per_rank"])):
        print(f"{rank:<8}{w['prompt_tokens']:>14}{c['blocks_saved']:>14}"
              f"{w['connector_tokens_loaded']:>15}{w['pool_hit_blocks']:>11}"
              f"{w['iterations']:>8}{w['control_collectives'] / max(w['iterations'], 1):>14.2f}",
              file=out)
    return 0 if identical else 1
