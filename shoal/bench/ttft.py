"""`shoal bench ttft`: TTFT of a long shared prefix in a fresh engine with the prefix in the
pool vs recomputed, measured side by side in one run."""

from __future__ import annotations

import json
import statistics
import tempfile

import torch

from shoal import LLM, SamplingParams
from shoal.kv.kv_cache_manager import cdiv

ONE = SamplingParams(max_tokens=1)


def _prompt(llm: LLM, num_tokens: int) -> list[int]:
    if llm.config.model.startswith("random:"):  # no tokenizer: random token ids
        gen = torch.Generator().manual_seed(0)
        return torch.randint(3, llm.engine.info.vocab_size, (num_tokens,), generator=gen).tolist()
    text = " ".join(f"Clause {i}: the tenant keeps the harbor gate closed after dark."
                    for i in range(num_tokens // 8))
    ids = llm.tokenizer.encode(text)[:num_tokens - 16]
    return ids + llm.tokenizer.encode(" Question: what must the tenant do?")[:16]


def run_ttft(model: str, prefix_tokens: int, rounds: int, device: str, tp: int = 1) -> int:
    """tp > 1: every engine is a TP fleet (each rank saves and loads its shard). On a GPU the
    prompt is prefilled in one chunk (as fast as recomputing goes) and decode graphs are
    not captured (they play no part in a TTFT)."""
    kw = dict(device=device, tp_size=tp)
    if device.startswith("cuda"):
        kw.update(max_num_tokens=max(prefix_tokens, 2048), enforce_eager=True,
                  num_kv_blocks=cdiv(prefix_tokens, 16) + 64)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ttft-") as pool:
        recomputed, loaded, loaded_tokens = [], [], []
        with LLM(model, kv_pool=pool, **kw) as llm:  # computes and saves
            prompt = _prompt(llm, prefix_tokens)
            # not a baseline: the process's first forward also pays one-time start-up
            # (library initialisation, first-touch of memory)
            first_s = llm.generate([prompt], ONE)[0].metrics.ttft_s
        for _ in range(rounds):
            with LLM(model, kv_pool=pool, **kw) as llm:  # fresh engine, pool hit
                out = llm.generate([prompt], ONE)[0]
                loaded.append(out.metrics.ttft_s)
                loaded_tokens.append(out.num_connector_tokens)
                bytes_loaded = llm.stats()["bytes_loaded"]
            with LLM(model, **kw) as llm:  # fresh engine, no pool: recompute
                recomputed.append(llm.generate([prompt], ONE)[0].metrics.ttft_s)
    result = {
        "bench": "ttft", "model": model, "device": device, "tp": tp, "prompt_tokens": len(prompt),
        "rounds": rounds, "tokens_loaded": loaded_tokens[0], "bytes_loaded": bytes_loaded,
        "ttft_recomputed_s": statistics.median(recomputed),
        "ttft_pool_s": statistics.median(loaded),
        "ratio_pool_over_recomputed": statistics.median(loaded) / statistics.median(recomputed),
        "first_run_s": round(first_s, 4),
        "all_recomputed_s": [round(x, 4) for x in recomputed],
        "all_pool_s": [round(x, 4) for x in loaded],
    }
    print(f"{len(prompt)}-token prompt, fresh engines{f' (tp={tp})' if tp > 1 else ''}, "
          f"median of {rounds} rounds")
    print(f"  TTFT recomputed          {result['ttft_recomputed_s']:8.3f} s")
    print(f"  TTFT from the pool       {result['ttft_pool_s']:8.3f} s  "
          f"({loaded_tokens[0]} tokens, {bytes_loaded / 1e9:.3f} GB loaded)")
    print(f"  ratio pool / recomputed  {result['ratio_pool_over_recomputed']:8.3f}")
    print(json.dumps(result))
    return 0


def run_ttft_dp(model: str, prefix_tokens: int, dp: int, device: str) -> int:
    """Two owners sharing the pool: owner 0 of a first fleet computes and saves the prefix;
    a fresh fleet then serves the prompt and a sibling (same prefix, other question) at
    once, one per owner. The second owner's TTFT shows what owner 0's saves save it."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ttft-dp-") as pool:
        with LLM(model, kv_pool=pool, device=device, dp_size=dp) as llm:
            prompt = _prompt(llm, prefix_tokens)
            sibling = prompt[:-16] + llm.tokenizer.encode(" Question: who keeps the gate?")[:16]
            cold = llm.generate([prompt], ONE)[0]  # the router gives it to owner 0
            saved = [s["blocks_saved"] for s in llm.stats()["per_rank"]]
        with LLM(model, kv_pool=pool, device=device, dp_size=dp) as llm:
            warm = llm.generate([prompt, sibling], ONE)  # one per owner
            loaded = [s["connector_tokens_loaded"] for s in llm.stats()["per_rank"]]
    result = {"bench": "ttft", "dp": dp, "model": model, "prompt_tokens": len(prompt),
              "blocks_saved_per_owner_cold": saved, "tokens_loaded_per_owner_warm": loaded,
              "ttft_cold_s": cold.metrics.ttft_s,
              "ttft_warm_owner0_s": warm[0].metrics.ttft_s,
              "ttft_warm_owner1_s": warm[1].metrics.ttft_s,
              "ratio_owner1_over_cold": warm[1].metrics.ttft_s / cold.metrics.ttft_s}
    print(f"{len(prompt)}-token prompt, {dp} ADP owners sharing one pool")
    print(f"  cold (owner 0 computes, saves {saved} blocks per owner)   {cold.metrics.ttft_s:8.3f} s")
    print(f"  warm fleet, owner 0 (loads its own saves)        {warm[0].metrics.ttft_s:8.3f} s")
    print(f"  warm fleet, owner 1 (loads owner 0's saves)      {warm[1].metrics.ttft_s:8.3f} s  "
          f"ratio {result['ratio_owner1_over_cold']:.3f}; tokens loaded per owner {loaded}")
    print(json.dumps(result))
    return 0
