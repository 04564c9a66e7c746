"""A pool hit's whole request time on the CPU, many times over: what an engine's wait for
its transfers adds (the poll pause, or the worker's `wait_for_transfers`).

    PYTHONPATH=$PWD python3 scripts/idle_wait_probe.py [0|1 (overlap loop)] [REQUESTS]

One engine computes and saves a 200-token prompt of a 2-layer SmolLM2 shape; a second one
(prefix caching off, loads whole) runs it REQUESTS times: each hits 192 tokens in files.
"""
import statistics
import sys
import tempfile
import time

import torch

from shoal import LLM, SamplingParams
from shoal.config import ConnectorConfig

overlap = len(sys.argv) > 1 and sys.argv[1] == "1"
num = int(sys.argv[2]) if len(sys.argv) > 2 else 30
root = tempfile.mkdtemp(prefix="shoal-idle-wait-")
kw = dict(device="cpu", block_size=16, num_kv_blocks=256, enable_prefix_caching=False,
          overlap_scheduler=overlap)
ids = torch.randint(3, 40000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
one = SamplingParams(max_tokens=1)
with LLM("random:smollm2-135m@2", kv_connector=ConnectorConfig(name="fs", options={"root": root}),
         **kw) as llm:
    llm.generate([ids], one)
with LLM("random:smollm2-135m@2", kv_connector=ConnectorConfig(
        name="fs", options={"root": root}, compute_while_loading=False), **kw) as llm:
    times = []
    for _ in range(num):
        start = time.perf_counter()
        out = llm.generate([ids], one)[0]
        times.append(time.perf_counter() - start)
print(f"overlap loop {overlap}: {out.pool_hit.num_loaded_tokens} tokens loaded, median "
      f"{statistics.median(times) * 1e3:.2f} ms a request over {num}")
