"""`shoal bench adp`: attention DP against a baseline measured in the same run.

- `--against dp1` (default): control cost per step vs forward time, and the throughput of
  N owners vs one, on the same work.
- `--against tp`: dp N vs tp N with the same KV memory per rank: the KV capacity (distinct
  tokens the fleet's caches hold) and the decode throughput. Under TP a model with
  multi-head latent attention keeps the whole latent on every rank (its heads share it),
  so dp N holds N times the tokens; a GQA model's KV heads split, and both hold the same.
"""

from __future__ import annotations

import json
import random
import time

from shoal import LLM, SamplingParams

STEP_FIELDS = ("iterations", "forward_passes", "control_collectives", "control_seconds",
               "forward_seconds")


def _prompts(model: str, num_prompts: int) -> list[list[int]]:
    """Chat prompts, or random token ids for a random or tokenizer-less checkpoint (no
    engine is started for either)."""
    from shoal.model.loader import load_model_config, load_tokenizer_only
    tokenizer = load_tokenizer_only(model)
    if not tokenizer.is_available:
        rng = random.Random(0)
        vocab = load_model_config(model).vocab_size
        return [[rng.randrange(vocab) for _ in range(24 + i % 7)] for i in range(num_prompts)]
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Tell me a fact about the number {i}."}])
        for i in range(num_prompts)]


def _run(model: str, prompts, sampling, device: str, **fleet) -> dict:
    with LLM(model, device=device, **fleet) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        before = llm.stats()["per_rank"]
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        after = llm.stats()["per_rank"]
    delta = [{k: a[k] - b[k] for k in STEP_FIELDS} for a, b in zip(after, before)]
    steps = sum(d["iterations"] for d in delta)
    # distinct tokens the caches hold: TP ranks hold the same tokens, owners their own
    blocks = after[0]["num_kv_blocks"] if fleet.get("tp_size", 1) > 1 else sum(
        s["num_kv_blocks"] for s in after)
    return {
        "fleet": " ".join(f"{k.removesuffix('_size')}={v}" for k, v in fleet.items()
                          if k in ("tp_size", "dp_size")) or "dp=1",
        "seconds": elapsed,
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "kv_capacity_tokens": blocks * fleet.get("block_size", 16),
        "control_collectives_per_step": sum(d["control_collectives"] for d in delta) / steps,
        "control_ms_per_step": 1e3 * sum(d["control_seconds"] for d in delta) / steps,
        "forward_ms_per_pass": 1e3 * sum(d["forward_seconds"] for d in delta)
        / max(sum(d["forward_passes"] for d in delta), 1),
        "tokens": [o.token_ids for o in outs],
    }


def run_adp(model: str, num_prompts: int, max_tokens: int, device: str, size: int = 2,
            against: str = "dp1", kv_cache_gb: float = 1.0) -> int:
    prompts = _prompts(model, num_prompts)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    memory = dict(kv_cache_gb=kv_cache_gb, block_size=16)
    base = dict(tp_size=size) if against == "tp" else {}
    base_run = _run(model, prompts, sampling, device, **base, **memory)
    dp_run = _run(model, prompts, sampling, device, dp_size=size, **memory)
    runs = (base_run, dp_run)
    result = {"bench": "adp", "model": model, "against": against, "size": size,
              "num_prompts": num_prompts, "max_tokens": max_tokens, "kv_cache_gb": kv_cache_gb,
              "identical_outputs": base_run["tokens"] == dp_run["tokens"],
              "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
              "throughput_dp_over_base": dp_run["tokens_per_s"] / base_run["tokens_per_s"],
              "kv_capacity_dp_over_base": dp_run["kv_capacity_tokens"]
              / base_run["kv_capacity_tokens"]}
    print(f"{num_prompts} prompts x {max_tokens} tokens, {model}, {kv_cache_gb} GB of KV per rank")
    print(f"{'':<10}{'tok/s':>9}{'KV tokens':>11}{'ctrl/step':>11}{'ctrl ms/step':>14}"
          f"{'fwd ms/pass':>13}")
    for r in runs:
        print(f"{r['fleet']:<10}{r['tokens_per_s']:>9.1f}{r['kv_capacity_tokens']:>11}"
              f"{r['control_collectives_per_step']:>11.2f}{r['control_ms_per_step']:>14.3f}"
              f"{r['forward_ms_per_pass']:>13.1f}")
    print(f"dp={size} / {base_run['fleet']}: throughput {result['throughput_dp_over_base']:.2f}, "
          f"KV capacity {result['kv_capacity_dp_over_base']:.2f}; outputs identical: "
          f"{result['identical_outputs']}")
    print(json.dumps(result))
    return 0
