"""What MLA's expanded prefill attention costs on the GPU, with and without cuDNN's SDPA.

    PYTHONPATH=$PWD python3 scripts/mla_sdpa_probe.py                the probe below
    PYTHONPATH=$PWD python3 scripts/mla_sdpa_probe.py ttft ARGS      `shoal bench ttft ARGS`
    PYTHONPATH=$PWD python3 scripts/mla_sdpa_probe.py ttft-cudnn ARGS   the same with cuDNN's
                                                                     backend allowed again

`causal_attention` (shoal.model.attention_backend, which leaves cuDNN's backend out on a
GPU) at DeepSeek-V2-Lite's head shape (16 heads, q/k 192 wide, v 128) for a prefix hit's
tail (n new tokens after a long context) and a whole prompt: the first call of each shape
(a backend that builds a plan per shape pays it there) and the median of 20 after; then the
same with cuDNN's backend allowed (PyTorch tries it first on H100/H200 with cuDNN > 9.15).
"""
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend

import shoal.model.attention_backend as ab

WITH_CUDNN = [SDPBackend.CUDNN_ATTENTION, *ab.GPU_SDPA]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


if sys.argv[1:2] in (["ttft"], ["ttft-cudnn"]):
    if sys.argv[1] == "ttft-cudnn":
        ab.GPU_SDPA = WITH_CUDNN
    from shoal.cli import main
    sys.exit(main(["bench", "ttft", *sys.argv[2:]]))

shoal_backends = ab.GPU_SDPA
for name, backends in (("shoal", shoal_backends), ("cuDNN too", WITH_CUDNN)):
    ab.GPU_SDPA = backends
    for n, ctx in ((16, 8192), (6, 1984), (16, 8193), (2048, 2048), (8192, 8192)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(n, 16, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(16, ctx, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(16, ctx, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        first = timed(lambda: ab.causal_attention(q, k, v, 0.1))
        steady = statistics.median(timed(lambda: ab.causal_attention(q, k, v, 0.1))
                                   for _ in range(20))
        print(f"{name:9s} n={n:5d} ctx={ctx:5d}: first {1e3 * first:8.2f} ms, "
              f"then {1e3 * steady:7.3f} ms", flush=True)
