"""`shoal bench ttft`: TTFT of a long shared prefix in a fresh engine with the prefix in the
pool vs recomputed, measured side by side in one run."""

from __future__ import annotations

import json
import statistics
import tempfile

from shoal import LLM, SamplingParams

ONE = SamplingParams(max_tokens=1)


def _prompt(llm: LLM, num_tokens: int) -> list[int]:
    text = " ".join(f"Clause {i}: the tenant keeps the harbor gate closed after dark."
                    for i in range(num_tokens // 8))
    ids = llm.tokenizer.encode(text)[:num_tokens - 16]
    return ids + llm.tokenizer.encode(" Question: what must the tenant do?")[:16]


def run_ttft(model: str, prefix_tokens: int, rounds: int, device: str) -> int:
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ttft-") as pool:
        recomputed, loaded, loaded_tokens = [], [], []
        with LLM(model, kv_pool=pool, device=device) as llm:  # computes and saves
            prompt = _prompt(llm, prefix_tokens)
            recomputed.append(llm.generate([prompt], ONE)[0].metrics.ttft_s)
        for _ in range(rounds):
            with LLM(model, kv_pool=pool, device=device) as llm:  # fresh engine, pool hit
                out = llm.generate([prompt], ONE)[0]
                loaded.append(out.metrics.ttft_s)
                loaded_tokens.append(out.num_connector_tokens)
            with LLM(model, device=device) as llm:  # fresh engine, no pool: recompute
                recomputed.append(llm.generate([prompt], ONE)[0].metrics.ttft_s)
    result = {
        "bench": "ttft", "model": model, "device": device, "prompt_tokens": len(prompt),
        "rounds": rounds, "tokens_loaded": loaded_tokens[0],
        "ttft_recomputed_s": statistics.median(recomputed),
        "ttft_pool_s": statistics.median(loaded),
        "ratio_pool_over_recomputed": statistics.median(loaded) / statistics.median(recomputed),
        "all_recomputed_s": [round(x, 4) for x in recomputed],
        "all_pool_s": [round(x, 4) for x in loaded],
    }
    print(f"{len(prompt)}-token prompt, fresh engines, median of {rounds} rounds")
    print(f"  TTFT recomputed          {result['ttft_recomputed_s']:8.3f} s")
    print(f"  TTFT from the pool       {result['ttft_pool_s']:8.3f} s  "
          f"({loaded_tokens[0]} tokens loaded)")
    print(f"  ratio pool / recomputed  {result['ratio_pool_over_recomputed']:8.3f}  (goal <= 0.05)")
    print(json.dumps(result))
    return 0
