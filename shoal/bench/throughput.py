"""`shoal bench throughput`: generation tokens/s of Shoal vs `transformers` generate on the
same prompts in the same run, and TTFT of a repeated long prompt (local prefix hit).

Prompts are chat prompts through the model's tokenizer, or (`--prompt-len N`, and always
for `random:<shape>` checkpoints, which have no tokenizer) N random token ids each. On CUDA
transformers runs twice per round: with its default SDPA backends and with cuDNN's turned
off (often much faster); both ratios are reported, and Shoal's decode step is set next to
the time to read the weights once from device memory (measured bandwidth) and next to the
floor: the weights plus the batch's K and V at its mean context over the decode steps.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from shoal import LLM, SamplingParams
from shoal.util import cdiv
from shoal.model.loader import resolve_model_path

TOPICS = ["the ocean", "a lighthouse", "mountains", "a library", "the moon", "a bakery",
          "trains", "winter", "a garden", "robots", "the desert", "music", "a market",
          "rivers", "bicycles", "stars"]


def _load_reference(model: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                   dtype=dtype)
    else:
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return ref.eval().to(device)


def _hf_generate(ref, prompts: list[list[int]], max_tokens: int, pad_id: int,
                 cudnn: bool = True) -> float:
    """Seconds for one batched greedy generate of exactly max_tokens new tokens per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=ref.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ref.device)
    cuda = ref.device.type == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, pad_token_id=pad_id, temperature=None,
                           top_p=None, top_k=None)
    if cuda:
        torch.cuda.synchronize()
        torch.backends.cuda.enable_cudnn_sdp(True)
    assert out.shape[1] - width == max_tokens, out.shape
    return time.perf_counter() - start


def _memory_bandwidth(device: str) -> float:
    """Device memory bytes/s of a large copy (bytes read + written), the median of 5."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * x.numel() / statistics.median(times[1:])


def bench_prompts(llm: LLM, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`prompt_len` random token ids each (seeded: the same every run), or (0) chat prompts."""
    if prompt_len:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.info.vocab_size
        return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
                for _ in range(num_prompts)]
    tok = llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content":
                                      f"Write a short story about {TOPICS[i % len(TOPICS)]}."}])
            for i in range(num_prompts)]


def run_throughput(model: str, num_prompts: int, max_tokens: int, device: str,
                   rounds: int = 3, prompt_len: int = 0, dtype: str = "auto",
                   enforce_eager: bool = False) -> int:
    """Alternates Shoal and transformers `rounds` times on the same prompts (a machine's
    speed drifts between minutes) and reports medians and the median ratios."""
    if model.startswith("random:") and not prompt_len:
        prompt_len = 256  # no tokenizer: random token ids
    cuda = device.startswith("cuda")
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    total = num_prompts * max_tokens
    kw = dict(device=device, dtype=dtype, enforce_eager=enforce_eager)
    if cuda:  # the whole batch decodes together, as in transformers' generate
        kw.update(max_batch_size=num_prompts, max_num_tokens=16384,
                  num_kv_blocks=num_prompts * cdiv((prompt_len or 64) + max_tokens, 16) + 64)
    with LLM(model, **kw) as llm:
        prompts = bench_prompts(llm, num_prompts, prompt_len)
        params = list(llm.engine.model.parameters())  # one rank: the model is here
        torch_dtype = params[0].dtype
        weight_bytes = sum(p.numel() * p.element_size() for p in params)
        layout = llm.engine.kv_cache.layout
        kv_token_bytes = layout.block_nbytes // layout.block_size  # all layers' K and V
        ref = _load_reference(model, device, torch_dtype)
        # warm-up: the whole batch once (its prefill's kernel shapes compile here, not in a
        # timed round); each round under a cache salt of its own, so that no round reuses
        # an earlier one's prefix (transformers recomputes every prompt every round)
        llm.generate(prompts, SamplingParams(max_tokens=2), cache_salt="warm-up")
        _hf_generate(ref, prompts[:2], 4, pad_id=2)
        settings = ["default", "no_cudnn"] if cuda else ["default"]
        shoal_s, hf_s, decode_ms = [], {s: [] for s in settings}, []
        for round_ in range(rounds):
            start = time.perf_counter()
            outs = llm.generate(prompts, sampling, cache_salt=f"round-{round_}")
            shoal_s.append(time.perf_counter() - start)
            assert all(len(o.token_ids) == max_tokens for o in outs)
            first = max(o.metrics.first_token_time for o in outs)
            end = max(o.metrics.finish_time for o in outs)
            decode_ms.append(1e3 * (end - first) / max(max_tokens - 1, 1))
            for s in settings:
                hf_s[s].append(_hf_generate(ref, prompts, max_tokens, pad_id=2,
                                            cudnn=s == "default"))
        del ref

        # TTFT of a long prompt computed, then the same prompt again (local prefix hit).
        if prompt_len:  # (within the model's context, with a token to generate)
            long_prompt = bench_prompts(llm, 1, min(1990, llm.engine.info.max_model_len - 1))[0]
        else:
            long_prompt = llm.tokenizer.encode(" ".join(
                f"Line {i}: the tide rose over the harbor wall." for i in range(150)))
        cold = llm.generate([long_prompt], SamplingParams(max_tokens=1))[0]
        warm = llm.generate([long_prompt], SamplingParams(max_tokens=1))[0]

    result = {
        "bench": "throughput", "model": model, "device": device, "dtype": str(torch_dtype),
        "num_prompts": num_prompts, "prompt_len": prompt_len or "chat", "max_tokens": max_tokens,
        "rounds": rounds, "enforce_eager": enforce_eager,
        "threads": torch.get_num_threads(),
        "shoal_tokens_per_s": total / statistics.median(shoal_s),
        "shoal_decode_ms_per_step": statistics.median(decode_ms),
        "long_prompt_tokens": len(long_prompt), "ttft_cold_s": cold.metrics.ttft_s,
        "ttft_prefix_hit_s": warm.metrics.ttft_s,
        "ttft_hit_over_cold": warm.metrics.ttft_s / cold.metrics.ttft_s,
        "prefix_hit_tokens": warm.num_local_prefix_tokens,
    }
    for s in settings:
        suffix = "" if s == "default" else f"_{s}"
        result[f"transformers{suffix}_tokens_per_s"] = total / statistics.median(hf_s[s])
        result[f"throughput_ratio{suffix}"] = statistics.median(
            h / t for h, t in zip(hf_s[s], shoal_s))
    if cuda:
        bandwidth = _memory_bandwidth(device)
        result["weight_bytes"] = weight_bytes
        result["memory_bandwidth_gbps"] = bandwidth / 1e9
        result["weights_read_ms"] = 1e3 * weight_bytes / bandwidth
        result["decode_over_weights_read"] = result["shoal_decode_ms_per_step"] / result["weights_read_ms"]
        # what a decode step must read at least: the weights, and every request's K and V
        # (its context averaged over the decode steps)
        context = (prompt_len or len(prompts[0])) + max_tokens / 2
        result["kv_read_ms"] = 1e3 * num_prompts * context * kv_token_bytes / bandwidth
        result["decode_floor_ms"] = result["weights_read_ms"] + result["kv_read_ms"]
        result["decode_over_floor"] = result["shoal_decode_ms_per_step"] / result["decode_floor_ms"]

    print(f"{model} on {device} ({torch_dtype}): {num_prompts} prompts x {max_tokens} new "
          f"tokens, median of {rounds} alternating rounds")
    print(f"{'':<36}{'tokens/s':>12}{'Shoal / it':>12}")
    print(f"{'Shoal':<36}{result['shoal_tokens_per_s']:>12.1f}")
    for s in settings:
        suffix = "" if s == "default" else f"_{s}"
        name = "transformers" + ("" if s == "default" else " (cuDNN SDPA off)")
        print(f"{name:<36}{result[f'transformers{suffix}_tokens_per_s']:>12.1f}"
              f"{result[f'throughput_ratio{suffix}']:>12.2f}")
    line = f"Shoal decode step: {result['shoal_decode_ms_per_step']:.2f} ms"
    if cuda:
        line += (f"; reading the weights ({weight_bytes / 1e9:.2f} GB) at "
                 f"{result['memory_bandwidth_gbps']:.0f} GB/s takes {result['weights_read_ms']:.2f} ms "
                 f"(ratio {result['decode_over_weights_read']:.2f}); with the KV of the batch "
                 f"the floor is {result['decode_floor_ms']:.2f} ms "
                 f"(ratio {result['decode_over_floor']:.2f})")
    print(line)
    print(f"TTFT of a {len(long_prompt)}-token prompt: cold {cold.metrics.ttft_s:.3f} s, "
          f"repeated (prefix hit, {warm.num_local_prefix_tokens} tokens reused) "
          f"{warm.metrics.ttft_s:.3f} s, ratio {result['ttft_hit_over_cold']:.3f}")
    print(json.dumps(result))
    return 0
