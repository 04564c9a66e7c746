"""`shoal bench adp`: control cost per step vs forward time, and throughput of 2 owners vs
1 on the same work, measured in one run (dp=1 in-process, then a dp=2 fleet)."""

from __future__ import annotations

import json
import time

from shoal import LLM, SamplingParams


def _run(model: str, dp: int, prompts, sampling, device: str) -> dict:
    with LLM(model, dp_size=dp, device=device) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        before = llm.stats()["per_rank"]
        start = time.perf_counter()
        outs = llm.generate(prompts, sampling)
        elapsed = time.perf_counter() - start
        after = llm.stats()["per_rank"]
    delta = [{k: a[k] - b[k] for k in ("iterations", "forward_passes", "control_collectives",
                                       "control_seconds", "forward_seconds")}
             for a, b in zip(after, before)]
    steps = sum(d["iterations"] for d in delta)
    return {
        "dp": dp, "seconds": elapsed,
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "control_collectives_per_step": sum(d["control_collectives"] for d in delta) / steps,
        "control_ms_per_step": 1e3 * sum(d["control_seconds"] for d in delta) / steps,
        "forward_ms_per_pass": 1e3 * sum(d["forward_seconds"] for d in delta)
        / max(sum(d["forward_passes"] for d in delta), 1),
        "tokens": [o.token_ids for o in outs],
    }


def run_adp(model: str, num_prompts: int, max_tokens: int, device: str) -> int:
    with LLM(model) as llm:
        prompts = [llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me a fact about the number {i}."}])
            for i in range(num_prompts)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    one, two = (_run(model, dp, prompts, sampling, device) for dp in (1, 2))
    result = {"bench": "adp", "model": model, "num_prompts": num_prompts,
              "max_tokens": max_tokens, "identical_outputs": one["tokens"] == two["tokens"],
              **{f"dp{r['dp']}_{k}": v for r in (one, two) for k, v in r.items()
                 if k not in ("dp", "tokens")},
              "throughput_dp2_over_dp1": two["tokens_per_s"] / one["tokens_per_s"]}
    print(f"{num_prompts} prompts x {max_tokens} tokens, {model}")
    print(f"{'':<12}{'tok/s':>9}{'ctrl/step':>11}{'ctrl ms/step':>14}{'fwd ms/pass':>13}")
    for r in (one, two):
        print(f"{'dp=' + str(r['dp']):<12}{r['tokens_per_s']:>9.1f}"
              f"{r['control_collectives_per_step']:>11.2f}{r['control_ms_per_step']:>14.3f}"
              f"{r['forward_ms_per_pass']:>13.1f}")
    print(f"throughput dp=2 / dp=1: {result['throughput_dp2_over_dp1']:.2f}; "
          f"outputs identical: {result['identical_outputs']}")
    print(json.dumps(result))
    return 0
