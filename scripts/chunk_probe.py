"""The forward of a short chunk over a long cached context (a prompt's rest after a pool
hit), on the GPU (the prefill kernel alone, by parts: scripts/parts_probe.py): an
engine's TTFT for the last 64 tokens of a prompt whose first 8128 tokens are cached
(prefix caching, no pool), eager and from a captured prefill graph, with each step's
wall time on the executing thread (PROFILE=1: the step's top CUDA kernels).

    PYTHONPATH=$PWD python3 scripts/chunk_probe.py [random:llama-8b] [8192]
"""
import os
import sys
import time

import torch

from shoal import LLM
from shoal.bench.ttft import ONE, _prompt
from shoal.engine.model_runner import ModelRunner
from shoal.util import cdiv

model = sys.argv[1] if len(sys.argv) > 1 else "random:llama-8b"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
dev = torch.device(os.environ.get("DEVICE", "cuda"))
kw = dict(device=dev.type, block_size=64, max_num_tokens=max(n, 2048), max_batch_size=1,
          num_kv_blocks=cdiv(n, 64) * 2 + 64)
execute = ModelRunner.execute
walls = []


def timed(self, batch, *args, **kwargs):
    start = time.perf_counter()
    try:
        return execute(self, batch, *args, **kwargs)
    finally:
        walls.append((batch.num_tokens, round((time.perf_counter() - start) * 1e3, 2)))


for eager in (True, False):
    label = "eager" if eager else "graphs"
    start = time.perf_counter()
    with LLM(model, enforce_eager=eager, **kw) as llm:
        print(f"bring-up ({label}): {time.perf_counter() - start:.1f} s")
        prompt = _prompt(llm, n)
        times = []
        for i in range(4):
            tail = (torch.randint(3, 1000, (64,)) + i).tolist()
            llm.generate([prompt[:n - 64] + tail[::-1]], ONE)  # computes (and caches) all
            out = llm.generate([prompt[:n - 64] + tail], ONE)[0]  # 8128 cached, 64 new
            times.append(out.metrics.ttft_s)
        print(f"engine, last 64 of {n} ({label}): TTFT {[round(t * 1e3, 1) for t in times]} ms")
        ModelRunner.execute = timed
        walls.clear()
        for i in range(3):
            llm.generate([prompt[:n - 64] + list(range(100 + i, 164 + i))], ONE)
        ModelRunner.execute = execute
        print(f"execute wall ({label}; tokens, ms):", walls)
        if dev.type == "cuda" and os.environ.get("PROFILE"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate([prompt[:n - 64] + list(range(5, 69))], ONE)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                            max_name_column_width=60))
