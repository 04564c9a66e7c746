"""GPU time of the prefill kernel for a short chunk over a long context, by how many parts
its context is cut into (paged_attention.prefill_parts picks one): each call captured in a
CUDA graph and replayed, so the time is the kernels', not the host's launches.

    PYTHONPATH=$PWD python3 scripts/parts_probe.py [new] [context]
"""
import sys

import torch

from shoal.model import paged_attention as pa
from shoal.util import cdiv

new = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
dev = torch.device("cuda")
for name, hq, hkv, d in (("llama-8b", 32, 8, 128), ("llama-1b", 32, 8, 64)):
    bs = 64
    blocks = cdiv(ctx, bs)
    k = torch.randn(blocks, bs, hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn(new, hq, d, dtype=torch.bfloat16, device=dev)
    table = torch.randperm(blocks, device=dev).to(torch.int32)[None]
    i32 = lambda x: torch.tensor([x], dtype=torch.int32, device=dev)  # noqa: E731
    args = (q, k, v, table, i32(0), i32(new), i32(ctx), new)
    ref = pa.paged_prefill(*args, parts=1).float()
    auto = pa.prefill_parts(dev, cdiv(new, pa.PREFILL_TILE) * hq, ctx)
    line = []
    for parts in (1, 4, 9, 16, 24, 32, 48, 64):
        out = pa.paged_prefill(*args, parts=parts)  # compiles, and checks
        err = ((out.float() - ref).norm() / ref.norm()).item()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                pa.paged_prefill(*args, parts=parts)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        begin.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = begin.elapsed_time(end) / 100 * 1e3
        line.append(f"{parts}{'*' if parts == auto else ''}: {us:.0f} us ({err:.0e})")
    print(f"{name} {new} new over {ctx}: " + ", ".join(line))
