"""`shoal bench throughput`: generation tokens/s of Shoal vs `transformers` generate on the
same prompts in the same run, and TTFT of a repeated long prompt (local prefix hit)."""

from __future__ import annotations

import json
import statistics
import time
import torch

from shoal import LLM, SamplingParams
from shoal.model.loader import resolve_model_path

TOPICS = ["the ocean", "a lighthouse", "mountains", "a library", "the moon", "a bakery",
          "trains", "winter", "a garden", "robots", "the desert", "music", "a market",
          "rivers", "bicycles", "stars"]


def _load_reference(model: str, device: str):
    from transformers import AutoModelForCausalLM
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   dtype=torch.float32)
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return ref.eval().to(device)


def _hf_generate(ref, prompts: list[list[int]], max_tokens: int, pad_id: int) -> float:
    """Seconds for one batched greedy generate of exactly max_tokens new tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=ref.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ref.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, pad_token_id=pad_id, temperature=None,
                           top_p=None, top_k=None)
    if ref.device.type == "cuda":
        torch.cuda.synchronize()
    assert out.shape[1] - width == max_tokens, out.shape
    return time.perf_counter() - start


def run_throughput(model: str, num_prompts: int, max_tokens: int, device: str,
                   rounds: int = 3) -> int:
    """Alternates Shoal and transformers `rounds` times on the same prompts (this machine's
    speed drifts by 10-20% between minutes) and reports medians and the median ratio."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    total = num_prompts * max_tokens
    with LLM(model, device=device) as llm:
        tok = llm.tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content":
                                             f"Write a short story about {TOPICS[i % len(TOPICS)]}."}])
                   for i in range(num_prompts)]
        ref = _load_reference(model, device)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        _hf_generate(ref, prompts[:2], 4, pad_id=2)
        shoal_s, hf_s = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling)
            shoal_s.append(time.perf_counter() - start)
            assert all(len(o.token_ids) == max_tokens for o in outs)
            hf_s.append(_hf_generate(ref, prompts, max_tokens, pad_id=2))
        del ref

        # TTFT of a long prompt computed, then the same prompt again (local prefix hit).
        long_prompt = tok.encode(" ".join(f"Line {i}: the tide rose over the harbor wall."
                                          for i in range(150)))
        cold = llm.generate([long_prompt], SamplingParams(max_tokens=1))[0]
        warm = llm.generate([long_prompt], SamplingParams(max_tokens=1))[0]

    result = {
        "bench": "throughput", "model": model, "device": device, "num_prompts": num_prompts,
        "max_tokens": max_tokens, "rounds": rounds, "threads": torch.get_num_threads(),
        "shoal_tokens_per_s": total / statistics.median(shoal_s),
        "transformers_tokens_per_s": total / statistics.median(hf_s),
        "throughput_ratio": statistics.median(h / s for h, s in zip(hf_s, shoal_s)),
        "per_round_ratios": [round(h / s, 3) for h, s in zip(hf_s, shoal_s)],
        "long_prompt_tokens": len(long_prompt), "ttft_cold_s": cold.metrics.ttft_s,
        "ttft_prefix_hit_s": warm.metrics.ttft_s,
        "ttft_hit_over_cold": warm.metrics.ttft_s / cold.metrics.ttft_s,
        "prefix_hit_tokens": warm.num_local_prefix_tokens,
    }
    print(f"{num_prompts} prompts x {max_tokens} new tokens, median of {rounds} alternating rounds")
    print(f"{'':<34}{'Shoal':>12}{'transformers':>14}")
    print(f"{'generation tokens/s':<34}{result['shoal_tokens_per_s']:>12.1f}"
          f"{result['transformers_tokens_per_s']:>14.1f}")
    print(f"{'ratio Shoal / transformers':<34}{result['throughput_ratio']:>12.2f}"
          f"   (rounds: {result['per_round_ratios']})")
    print(f"TTFT of a {len(long_prompt)}-token prompt: cold {cold.metrics.ttft_s:.3f} s, "
          f"repeated (prefix hit, {warm.num_local_prefix_tokens} tokens reused) "
          f"{warm.metrics.ttft_s:.3f} s, ratio {result['ttft_hit_over_cold']:.3f}")
    print(json.dumps(result))
    return 0
