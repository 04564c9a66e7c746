"""`shoal bench structured`: what structured output costs a decode step. The same prompts
run free and with every request under a grammar, alternating in the same run; both ban the
end-of-sequence token (logit_bias -100) so every request decodes `max_tokens` tokens and
the two runs do the same work apart from the masks. Reported: decode tokens/s of each and
their ratio (constrained / free), plus the share of requests whose text matches.

The grammar (`--grammar`): "regex" (letters, digits, spaces and punctuation: a mask that
allows most of the vocabulary, so the model is barely steered) or "json" (an array of
strings: a JSON grammar that is never complete, so the masks keep changing with the text).
"""

from __future__ import annotations

import json
import re
import statistics

from shoal import LLM, SamplingParams, StructuredOutput
from shoal.bench.throughput import bench_prompts
from shoal.util import cdiv

GRAMMARS = {
    "regex": (r"[A-Za-z0-9 ,.;:'!?\n-]+", None),
    "json": (None, {"type": "array", "items": {"type": "string"}}),
}


def run_structured(model: str, num_prompts: int, max_tokens: int, device: str,
                   rounds: int = 3, grammar: str = "regex") -> int:
    if model.startswith("random:"):
        raise ValueError("bench structured needs a model with a tokenizer (a grammar is "
                         "matched against the vocabulary's text); random:<shape> has none")
    regex, schema = GRAMMARS[grammar]
    spec = StructuredOutput(regex=regex) if regex else StructuredOutput(json_schema=schema)
    kw = dict(device=device)
    if device.startswith("cuda"):
        kw.update(max_batch_size=num_prompts, max_num_tokens=16384,
                  num_kv_blocks=num_prompts * cdiv(64 + max_tokens, 16) + 64)
    with LLM(model, **kw) as llm:
        prompts = bench_prompts(llm, num_prompts, 0)
        no_eos = {t: -100.0 for t in llm.engine.eos_token_ids}
        free = SamplingParams(max_tokens=max_tokens, logit_bias=no_eos)
        bound = SamplingParams(max_tokens=max_tokens, logit_bias=no_eos, structured_output=spec)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_output=spec))  # warm-up
        rates = {"free": [], "constrained": []}
        matched = 0
        for _ in range(rounds):
            for name, sp in (("free", free), ("constrained", bound)):
                outs = llm.generate(prompts, sp)
                assert all(len(o.token_ids) == max_tokens for o in outs)
                first = max(o.metrics.first_token_time for o in outs)
                end = max(o.metrics.finish_time for o in outs)
                rates[name].append(num_prompts * (max_tokens - 1) / (end - first))
                if name == "constrained":
                    matched += sum(_matches(o.text, regex, schema) for o in outs)
    free_rate = statistics.median(rates["free"])
    bound_rate = statistics.median(rates["constrained"])
    result = {"bench": "structured", "model": model, "device": device, "grammar": grammar,
              "num_prompts": num_prompts, "max_tokens": max_tokens, "rounds": rounds,
              "free_decode_tokens_per_s": free_rate,
              "constrained_decode_tokens_per_s": bound_rate,
              "constrained_over_free": bound_rate / free_rate,
              "outputs_matching": matched / (rounds * num_prompts)}
    print(f"{model} on {device}: {num_prompts} requests x {max_tokens} tokens, grammar "
          f"{grammar}, median of {rounds} alternating rounds")
    print(f"decode tokens/s: free {free_rate:.1f}, constrained {bound_rate:.1f} "
          f"(ratio {result['constrained_over_free']:.3f}); outputs matching (a prefix of) "
          f"the grammar: {result['outputs_matching']:.0%}")
    print(json.dumps(result))
    return 0


def _matches(text: str, regex: str | None, schema: dict | None) -> bool:
    """Whether the text (cut at max_tokens) can still be completed to a match."""
    if regex is not None:
        return re.fullmatch(regex, text) is not None
    return text.lstrip().startswith("[")  # a JSON array under way (cut before its end)
