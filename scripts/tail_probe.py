"""A prompt's last chunk over a long cached context, timed and profiled (issue 30: the
forward of 16 tokens after an 8k hit took 40 ms on DeepSeek-V2-Lite's shape, 1 ms on Llama-1B's).

    PYTHONPATH=$PWD python3 scripts/tail_probe.py random:deepseek-v2-lite@9 8192

One engine: the whole prompt, then prompts sharing all but its last 16 tokens (a local
prefix hit: the same forward a pool hit ends with), each timed; the third under the torch
profiler (top ops by host and by GPU time)."""

import os
import sys
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench.ttft import _prompt

model, n = sys.argv[1], int(sys.argv[2])
kw = dict(device=os.environ.get("DEVICE", "cuda"), block_size=16, max_num_tokens=max(n, 2048),
          max_batch_size=1, num_kv_blocks=n // 16 + 64)
one = SamplingParams(max_tokens=1)
with LLM(model, **kw) as llm:
    base = _prompt(llm, n)
    vocab = llm.engine.info.vocab_size

    def run(prompt) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - start

    print(f"whole prompt: {run(base) * 1e3:.1f} ms", flush=True)
    for i in range(5):
        prompt = base[:n - 16] + [(t + i + 1) % vocab for t in base[n - 16:]]
        if i == 2:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=acts) as prof:
                spent = run(prompt)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            if torch.cuda.is_available():
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
        else:
            spent = run(prompt)
        print(f"tail {i}: {spent * 1e3:.1f} ms", flush=True)
