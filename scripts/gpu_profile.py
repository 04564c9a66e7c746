"""Where a step's time goes on the GPU (run on the lent H200).

    PYTHONPATH=$PWD python3 scripts/gpu_profile.py random:smollm2-135m 64 [overlap|plain]

1. TTFT of one 2000-token prompt, fresh each time (no prefix caching): wall time and the
   CUDA kernels' time (torch.profiler), to see whether prefill is the GPU or the host.
2. Decode steps of a batch: wall time per step; then torch.profiler over 10 steps (the
   GPU's busy time per step against the wall); then cProfile on the calling thread (the
   host's share, function by function).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from shoal import LLM, SamplingParams
from shoal.request import NewRequest


def _gpu_ms(prof) -> float:
    """Summed device time of the CUDA kernels and copies a profile saw, in ms."""
    return sum(e.device_time_total for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def main(model: str, batch: int, loop: str = "overlap") -> None:
    sp1 = SamplingParams(max_tokens=1)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with LLM(model, device="cuda", max_batch_size=batch, max_num_tokens=16384,
             num_kv_blocks=batch * 48 + 256, enable_prefix_caching=False,
             overlap_scheduler=loop == "overlap") as llm:
        vocab = llm.engine.info.vocab_size
        g = torch.Generator().manual_seed(0)
        long_prompt = torch.randint(3, vocab, (2000,), generator=g).tolist()
        for i in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = llm.generate([long_prompt], sp1)[0]
            print(f"ttft run {i}: {out.metrics.ttft_s:.4f} s (wall {time.perf_counter() - start:.4f})")
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate([long_prompt], sp1)
        print(f"prefill: GPU busy {_gpu_ms(prof):.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))

        engine = llm.engine
        prompts = [torch.randint(3, vocab, (512,), generator=g).tolist() for _ in range(batch)]
        rids = [engine.add(NewRequest(p, SamplingParams(max_tokens=80, ignore_eos=True)))
                for p in prompts]
        live = engine.live_requests()
        while not all(live[r].output_token_ids for r in rids):  # the prefills
            engine.step()
        engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 20 * 1e3
        print(f"decode ({loop} loop): {wall:.2f} ms/step at batch {batch} "
              f"(graph replays: {getattr(engine.runner.graphs, 'num_replays', None)})")
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        print(f"decode: GPU busy {_gpu_ms(prof) / 10:.2f} ms/step")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            engine.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
        while engine.has_work:
            engine.step()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
