"""Prefill attention on the GPU: the paged Triton kernel against SDPA's flash kernel, and
where a whole prefill's time goes (issue 26's prefill MFU; run on the lent GPU).

    PYTHONPATH=$PWD [SECTIONS=attention,decode,mla,gemms,families,steps] \
        python3 scripts/prefill_attn_probe.py [OLD_TREE] [CONFIGS] [MODEL] [DECODE_CONFIGS]

1. Attention alone, 8 prompts x 4096 tokens from nothing, for Llama-1B's heads (32 query
   heads, 8 KV heads, dim 64) and Llama-8B's (dim 128), bf16, blocks of 16 in a shuffled
   table: TFLOP/s of the kernel in OLD_TREE (default .base: the tree before the change),
   of this tree's at each CONFIGS entry (BLOCK_M:BLOCK_N:warps:stages, comma-separated)
   and at the first one over a cache whose blocks keep their heads outermost, and of SDPA's
   flash kernel on contiguous tensors (no table: the bar to clear). Then a short chunk
   over a long context (64 new tokens over 8192, the rest of a prompt after a pool hit)
   for the split-context path. Each output is checked against the old kernel's.
2. Decode alone: 256 rows over 320 and 2048 keys each (a throughput bench's batch, a long
   context), the same heads and SmolLM2-135M's (9 query heads, 3 KV heads, dim 64): the
   K/V bytes read per second by the old kernel and by this tree's at each DECODE_CONFIGS
   entry (TILE:warps:stages; pTILE:warps: the kernel of scripts/decode_prefetch.py), and
   at the first entry of each kind over a cache whose blocks keep their heads outermost.
3. DeepSeek-V2-Lite's latent decode, old kernel and new, 256 rows over 320 and 2048 keys.
4. The 1B and 8B dense layers' matmuls of a 16384-token step, each alone, in TFLOP/s.
5. MODEL (default random:llama-1b): one round of 8 x 4096 through `LLM.generate` under
   torch.profiler, the GPU's time by kernel family.
6. MODEL's decode step at 256 rows over ~320 keys (a throughput bench's batch): 256
   prompts of 320 tokens to 1 token and to 33, each under torch.profiler; the difference
   by kernel family over the 32 decode steps is a step's GPU time by family.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from shoal.model import paged_attention as pa

BLOCK = 16


def _load(tree: str):
    spec = importlib.util.spec_from_file_location(
        "old_paged_attention", f"{tree}/shoal/model/paged_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _time(fn, reps: int = 10) -> float:
    """Median seconds of `fn` by CUDA events, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _case(num_prompts, new, ctx, hq, hkv, d):
    """Queries, a shuffled paged cache and the step's layout tensors."""
    g = torch.Generator(device="cuda").manual_seed(0)
    per = -(-ctx // BLOCK)
    blocks = num_prompts * per + 1
    cache = torch.randn(blocks, 2, BLOCK, hkv, d, dtype=torch.bfloat16, device="cuda",
                        generator=g)
    table = torch.randperm(blocks - 1, device="cuda", generator=g)[:num_prompts * per]
    table = table.view(num_prompts, per).to(torch.int32)
    q = torch.randn(num_prompts * new, hq, d, dtype=torch.bfloat16, device="cuda", generator=g)
    i32 = dict(dtype=torch.int32, device="cuda")
    starts = torch.arange(0, num_prompts * new, new, **i32)
    lens = torch.full((num_prompts,), new, **i32)
    ctxs = torch.full((num_prompts,), ctx, **i32)
    return q, cache[:, 0], cache[:, 1], table, starts, lens, ctxs


def _heads_outer(cache):
    """The same values [blocks, slot, head, dim] with a block's heads outermost in memory
    ([block, head, slot, dim]): a head's keys of a block are one run of bytes."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def _flops(num_prompts, new, ctx, hq, d):
    """Causal q.k and p.v: 2 FLOPs per product, (d + d) per pair, per head."""
    pairs = sum(ctx - new + i + 1 for i in range(new))
    return num_prompts * hq * 2 * d * 2 * pairs


def attention(old, configs):
    for name, (hq, hkv, d) in (("1B", (32, 8, 64)), ("8B", (32, 8, 128))):
        for num_prompts, new, ctx in ((8, 4096, 4096), (8, 64, 8192)):
            q, k_cache, v_cache, table, starts, lens, ctxs = _case(num_prompts, new, ctx,
                                                                   hq, hkv, d)
            flops = _flops(num_prompts, new, ctx, hq, d)

            def run(mod):
                return lambda: mod.paged_prefill(q, k_cache, v_cache, table, starts, lens,
                                                 ctxs, new)
            ref = run(old)()
            print(f"== {name} heads {hq}/{hkv} dim {d}: {num_prompts} x {new} new over {ctx}")
            t = _time(run(old))
            print(f"  old kernel            {t * 1e3:8.3f} ms {flops / t / 1e12:6.1f} TFLOP/s")
            for cfg in configs:
                pa.PREFILL_TILE, pa.PREFILL_KEYS, pa.PREFILL_WARPS, pa.PREFILL_STAGES = cfg
                try:
                    out = run(pa)()
                    err = (out.float() - ref.float()).abs().max().item()
                    t = _time(run(pa))
                    print(f"  new {':'.join(map(str, cfg)):17s} {t * 1e3:8.3f} ms "
                          f"{flops / t / 1e12:6.1f} TFLOP/s  max |new - old| {err:.3g}")
                except Exception as e:  # (a config that does not fit in shared memory)
                    print(f"  new {':'.join(map(str, cfg)):17s} failed: {str(e)[:100]}")
            pa.PREFILL_TILE, pa.PREFILL_KEYS, pa.PREFILL_WARPS, pa.PREFILL_STAGES = configs[0]
            k_cache, v_cache = _heads_outer(k_cache), _heads_outer(v_cache)
            try:
                err = (run(pa)().float() - ref.float()).abs().max().item()
                t = _time(run(pa))
                print(f"  new, heads-outer cache {t * 1e3:8.3f} ms "
                      f"{flops / t / 1e12:6.1f} TFLOP/s  max |new - old| {err:.3g}")
            except Exception as e:
                print(f"  new, heads-outer cache failed: {str(e)[:100]}")
            if new == ctx:
                qs = q.view(num_prompts, new, hq, d).transpose(1, 2)
                ks = torch.randn(num_prompts, hq, ctx, d, dtype=q.dtype, device="cuda")

                def flash():
                    with torch.nn.attention.sdpa_kernel(
                            torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(qs, ks, ks, is_causal=True)
                t = _time(flash)
                print(f"  SDPA flash (no table) {t * 1e3:8.3f} ms {flops / t / 1e12:6.1f} TFLOP/s")


def decode(old, configs, prefetch):
    """configs: this tree's kernel at (TILE, warps, stages); prefetch: scripts/
    decode_prefetch.py's kernel at (TILE, warps). Each over the token-major cache, and the
    first of each over a heads-outer one too."""
    from decode_prefetch import paged_decode_prefetch

    def shipped(cfg):
        def run(*args):
            pa.DECODE_KEYS, pa.DECODE_WARPS, pa.DECODE_STAGES = cfg
            return pa.paged_decode(*args)
        return run
    variants = [(f"new {':'.join(map(str, c))}", shipped(c)) for c in configs]
    variants += [(f"prefetch {tile}:{warps}", lambda *a, tile=tile, warps=warps:
                  paged_decode_prefetch(*a, tile=tile, warps=warps)) for tile, warps in prefetch]
    firsts = {variants[0][0]} | ({variants[len(configs)][0]} if prefetch else set())
    for name, (hq, hkv, d) in (("135M", (9, 3, 64)), ("1B", (32, 8, 64)), ("8B", (32, 8, 128))):
        for rows, ctx in ((256, 320), (256, 2048)):
            q, k_cache, v_cache, table, _, _, ctxs = _case(rows, 1, ctx, hq, hkv, d)
            k_hnd, v_hnd = _heads_outer(k_cache), _heads_outer(v_cache)
            kv_bytes = 2 * rows * ctx * hkv * d * 2
            ref = old.paged_decode(q, k_cache, v_cache, table, ctxs)
            print(f"== decode {name} heads {hq}/{hkv} dim {d}: {rows} rows over {ctx} keys")
            t = _time(lambda: old.paged_decode(q, k_cache, v_cache, table, ctxs))
            print(f"  old kernel                    {t * 1e6:8.1f} us "
                  f"{kv_bytes / t / 1e9:7.0f} GB/s")
            for label, fn in variants:
                for layout, (k, v) in (("", (k_cache, v_cache)), (", heads outer", (k_hnd, v_hnd))):
                    if layout and label not in firsts:
                        continue
                    try:
                        err = (fn(q, k, v, table, ctxs).float() - ref.float()).abs().max().item()
                        t = _time(lambda: fn(q, k, v, table, ctxs))
                        print(f"  {label + layout:29s} {t * 1e6:8.1f} us "
                              f"{kv_bytes / t / 1e9:7.0f} GB/s  max |diff| {err:.3g}")
                    except Exception as e:
                        print(f"  {label + layout:29s} failed: {str(e)[:100]}")


def mla_decode(old_tree: str):
    """DeepSeek-V2-Lite's latent decode (16 heads, latent 512 + rotary 64), 256 rows."""
    from shoal.model import paged_mla
    spec = importlib.util.spec_from_file_location("old_paged_mla",
                                                  f"{old_tree}/shoal/model/paged_mla.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    for rows, ctx in ((256, 320), (256, 2048)):
        per = -(-ctx // BLOCK)
        cache = torch.randn(rows * per + 1, BLOCK, 1, 576, dtype=torch.bfloat16, device="cuda")
        table = torch.randperm(rows * per, device="cuda").view(rows, per).to(torch.int32)
        lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(rows, 16, 576, dtype=torch.bfloat16, device="cuda")
        nbytes = rows * ctx * 576 * 2
        ref = old.mla_decode(q, cache, table, lens, 512, 0.1)
        for label, mod in (("old", old), ("new", paged_mla)):
            err = (mod.mla_decode(q, cache, table, lens, 512, 0.1).float()
                   - ref.float()).abs().max().item()
            t = _time(lambda: mod.mla_decode(q, cache, table, lens, 512, 0.1))
            print(f"== MLA decode {rows} rows over {ctx}: {label} {t * 1e6:8.1f} us "
                  f"{nbytes / t / 1e9:7.0f} GB/s  max |diff| {err:.3g}")


def gemms(tokens: int = 16384):
    """The dense layers' matmuls of one prefill step (16384 tokens) for the 1B and 8B
    shapes, each alone: TFLOP/s, against a square 8192 matmul timed here too."""
    shapes = {"1B": (2048, 3072, 8192), "8B": (4096, 6144, 14336)}  # hidden, qkv, mlp
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = _time(lambda: a @ a)
    print(f"== matmuls: 8192 square {2 * 8192 ** 3 / t / 1e12:6.1f} TFLOP/s")
    for name, (hidden, qkv, mlp) in shapes.items():
        for label, k, n in (("qkv", hidden, qkv), ("o", hidden, hidden),
                            ("gate_up", hidden, 2 * mlp), ("down", mlp, hidden)):
            x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            t = _time(lambda: F.linear(x, w))
            print(f"  {name} {label:8s} [{tokens} x {k}] x [{k} x {n}] "
                  f"{2 * tokens * k * n / t / 1e12:6.1f} TFLOP/s")


def families(model: str):
    from shoal import LLM, SamplingParams
    from shoal.bench.throughput import bench_prompts
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    with LLM(model, device="cuda", max_num_tokens=16384, max_batch_size=8, block_size=BLOCK,
             num_kv_blocks=8 * 258 + 64) as llm:
        prompts = bench_prompts(llm, 8, 4096)
        llm.generate(prompts, one, cache_salt="warm")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, one, cache_salt="profiled")
    rows = [(e.key, e.device_time_total) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(t for _, t in rows)
    print(f"== {model}: 8 x 4096, GPU busy {total / 1e3:.1f} ms")
    for key, t in sorted(rows, key=lambda r: -r[1])[:14]:
        print(f"  {t / 1e3:8.2f} ms {t / total:6.1%}  {key[:90]}")


def _by_family(prof) -> dict[str, float]:
    return {e.key: e.device_time_total for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def decode_families(model: str, rows: int = 256, prompt: int = 320, steps: int = 32):
    from shoal import LLM, SamplingParams
    from shoal.bench.throughput import bench_prompts
    # every prompt's prefill in one step: the 32 steps after it decode all 256 rows (with a
    # smaller budget early rows would decode beside later rows' prefill chunks)
    with LLM(model, device="cuda", max_batch_size=rows, block_size=BLOCK,
             max_num_tokens=rows * prompt + rows,
             num_kv_blocks=rows * (-(-(prompt + steps + 1) // BLOCK)) + 64) as llm:
        prompts = bench_prompts(llm, rows, prompt)
        runs = {}
        for n in (1, steps + 1, 1, steps + 1):  # the first two warm up
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True),
                             cache_salt=f"d{n}-{len(runs)}")
            runs[n] = _by_family(prof)
    diff = {k: (t - runs[1].get(k, 0.0)) / steps for k, t in runs[steps + 1].items()}
    total = sum(diff.values())
    print(f"== {model}: decode step at {rows} rows over ~{prompt + steps // 2} keys, "
          f"GPU busy {total / 1e3:.3f} ms a step")
    for key, t in sorted(diff.items(), key=lambda r: -r[1])[:14]:
        print(f"  {t / 1e3:8.3f} ms {t / total:6.1%}  {key[:90]}")


if __name__ == "__main__":
    old_tree = sys.argv[1] if len(sys.argv) > 1 else ".base"
    model = sys.argv[3] if len(sys.argv) > 3 else "random:llama-1b"
    sections = os.environ.get("SECTIONS", "attention,decode,mla,gemms,families,steps")
    old = _load(old_tree)
    configs = [tuple(int(x) for x in c.split(":"))
               for c in (sys.argv[2] if len(sys.argv) > 2 else "64:64:4:2").split(",")]
    if "attention" in sections:
        attention(old, configs)
    pa.PREFILL_TILE, pa.PREFILL_KEYS, pa.PREFILL_WARPS, pa.PREFILL_STAGES = configs[0]
    if "decode" in sections:
        shipped = pa.DECODE_KEYS, pa.DECODE_WARPS, pa.DECODE_STAGES
        cfgs = (sys.argv[4] if len(sys.argv) > 4 else "64:4:2").split(",")
        decode(old, [tuple(int(x) for x in c.split(":")) for c in cfgs if c[0] != "p"],
               [tuple(int(x) for x in c[1:].split(":")) for c in cfgs if c[0] == "p"])
        pa.DECODE_KEYS, pa.DECODE_WARPS, pa.DECODE_STAGES = shipped
    if "mla" in sections:
        mla_decode(old_tree)
    if "gemms" in sections:
        gemms()
    if "families" in sections:
        families(model)
    if "steps" in sections:
        decode_families(model)
