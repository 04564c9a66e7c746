"""What MLA's expanded prefill attention costs on the GPU, by SDPA backend.

    PYTHONPATH=$PWD python3 scripts/mla_sdpa_probe.py             the probe below
    PYTHONPATH=$PWD python3 scripts/mla_sdpa_probe.py ttft ARGS   `shoal bench ttft ARGS`
                                                                  with cuDNN's SDPA off

`causal_attention` (shoal.model.attention_backend) at DeepSeek-V2-Lite's head shape (16
heads, q/k 192 wide, v 128) for a prefix hit's tail (n new tokens after a long context)
and a whole prompt: the first call of each shape (a backend that builds a plan per shape
pays it there) and the median of 20 after, with PyTorch's default backend order and with
cuDNN's backend left out.
"""
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from shoal.model.attention_backend import causal_attention

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


if sys.argv[1:2] == ["ttft"]:
    import shoal.model.attention_backend as ab
    plain = ab.causal_attention

    def without_cudnn(*args, **kw):
        with sdpa_kernel(NO_CUDNN):
            return plain(*args, **kw)
    ab.causal_attention = without_cudnn
    import shoal.model.mla as mla
    mla.causal_attention = without_cudnn
    from shoal.cli import main
    sys.exit(main(["bench", "ttft", *sys.argv[2:]]))

for name, backends in (("default", None), ("no cuDNN", NO_CUDNN)):
    for n, ctx in ((16, 8192), (6, 1984), (16, 8193), (2048, 2048), (8192, 8192)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(n, 16, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(16, ctx, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(16, ctx, 128, device="cuda", dtype=torch.bfloat16, generator=g)

        def run():
            if backends is None:
                return causal_attention(q, k, v, 0.1)
            with sdpa_kernel(backends):
                return causal_attention(q, k, v, 0.1)
        first = timed(run)
        steady = statistics.median(timed(run) for _ in range(20))
        print(f"{name:9s} n={n:5d} ctx={ctx:5d}: first {1e3 * first:8.2f} ms, "
              f"then {1e3 * steady:7.3f} ms", flush=True)
