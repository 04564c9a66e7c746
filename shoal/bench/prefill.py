"""`shoal bench prefill`: how close prefill comes to the device's matmul rate (MFU).

N prompts of L random tokens each are computed from nothing (a cache salt per round: no
prefix hit) and sample one token; the time is from the call to the last first token, the
median of the rounds after a warm-up round. The work is counted from the model's shape
(`prefill_flops`): 2 FLOPs per weight a token meets (of a mixture of experts, the router's
top k) and causal attention. The rate it is held against is measured in the same run: a
large square matmul in the model's dtype, the fastest of 5 (`matmul_peak`).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench.throughput import bench_prompts
from shoal.model.moe import SparseMoE
from shoal.util import cdiv

BLOCK_SIZE = 16  # tokens per KV block (the cache holds every prompt at once)


def prefill_flops(model, prompt_len: int) -> float:
    """FLOPs to compute one prompt of `prompt_len` tokens with no cache, on one rank's
    model (LlamaModel): the decoder layers' matrices once per token (biases, norms and the
    embedding are not counted; of an expert's matrices the share a token is routed to) and
    causal attention (token i attends to i + 1 keys). The output head computes the last
    token's logits only."""
    cfg = model.cfg
    per_token = 0.0
    for layer in model.layers:
        experts = (layer.mlp.gate_up, layer.mlp.down) if isinstance(layer.mlp, SparseMoE) else ()
        for p in layer.parameters():
            if p.dim() >= 2:
                share = cfg.num_experts_per_tok / cfg.num_experts if any(
                    p is e for e in experts) else 1.0
                per_token += 2 * p.numel() * share
    qk_dim = cfg.qk_nope_head_dim + cfg.head_dim if cfg.is_mla else cfg.head_dim
    v_dim = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
    heads = model.layers[0].self_attn.num_heads  # (this rank's)
    # q.k and p.v: 2 FLOPs per product over L (L + 1) / 2 pairs, per head and layer
    attention = cfg.num_layers * heads * (qk_dim + v_dim) * prompt_len * (prompt_len + 1)
    return per_token * prompt_len + attention + 2 * model.lm_head.weight.numel()


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in `dtype` (8192 on a GPU, 2048 on a CPU): the fastest of 5
    timings after a warm-up, each of 8 back-to-back products on a GPU (the rate the device
    reaches, launches hidden), one on a CPU."""
    cuda = device.startswith("cuda")
    n, reps = (8192, 8) if cuda else (2048, 1)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(a.device)
        times.append((time.perf_counter() - start) / reps)
    return 2 * n ** 3 / min(times[1:])


def run_prefill(model: str, num_prompts: int, prompt_len: int, device: str, rounds: int = 3,
                dtype: str = "auto", max_num_tokens: int | None = None,
                enforce_eager: bool = False) -> int:
    """Prints a summary and one JSON line: tokens/s, achieved TFLOP/s, the matmul peak and
    their ratio (MFU)."""
    for flag, value in (("num-prompts", num_prompts), ("prompt-len", prompt_len),
                        ("rounds", rounds)):
        if value < 1:
            raise ValueError(f"bench prefill: --{flag} must be at least 1, got {value}")
    cuda = device.startswith("cuda")
    chunk = max_num_tokens or (16384 if cuda else 2048)
    kw = dict(device=device, dtype=dtype, enforce_eager=enforce_eager, max_num_tokens=chunk,
              max_batch_size=num_prompts, block_size=BLOCK_SIZE,
              num_kv_blocks=num_prompts * cdiv(prompt_len + 1, BLOCK_SIZE) + 64)
    seconds = []
    with LLM(model, **kw) as llm:
        context = llm.engine.info.max_model_len
        if prompt_len >= context:
            raise ValueError(f"--prompt-len {prompt_len} leaves no room to sample: the "
                             f"model's context is {context} tokens")
        prompts = bench_prompts(llm, num_prompts, prompt_len)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        for round_ in range(rounds + 1):  # the first warms up (kernels compile there)
            passes = llm.engine.stats()["forward_passes"]
            start = time.perf_counter()
            outs = llm.generate(prompts, one, cache_salt=f"prefill-{round_}")
            if any(o.num_local_prefix_tokens for o in outs):  # (a round of its own salt)
                raise RuntimeError("bench prefill: a prompt was served from the prefix cache")
            seconds.append(max(o.metrics.first_token_time for o in outs) - start)
            steps = llm.engine.stats()["forward_passes"] - passes
        model_ = llm.engine.model
        torch_dtype = next(model_.parameters()).dtype
        flops = num_prompts * prefill_flops(model_, prompt_len)
    peak = matmul_peak(device, torch_dtype)
    median = statistics.median(seconds[1:])
    result = {
        "bench": "prefill", "model": model, "device": device, "dtype": str(torch_dtype),
        "num_prompts": num_prompts, "prompt_len": prompt_len, "max_num_tokens": chunk,
        "rounds": rounds, "enforce_eager": enforce_eager, "steps_per_round": steps,
        "prefill_s": median,
        "tokens_per_s": num_prompts * prompt_len / median, "tflop": flops / 1e12,
        "achieved_tflops": flops / median / 1e12, "matmul_peak_tflops": peak / 1e12,
        "mfu": flops / median / peak,
    }
    print(f"{model} on {device} ({torch_dtype}): {num_prompts} prompts x {prompt_len} tokens "
          f"in steps of {chunk}, median of {rounds} rounds")
    print(f"prefill {median:.3f} s in {steps} steps, {result['tokens_per_s']:.0f} tokens/s, "
          f"{result['tflop']:.3g} TFLOP at {result['achieved_tflops']:.3g} TFLOP/s; a "
          f"{'8192' if cuda else '2048'}-square matmul runs at "
          f"{result['matmul_peak_tflops']:.3g}: MFU {result['mfu']:.2f}")
    print(json.dumps(result))
    return 0
