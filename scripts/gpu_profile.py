"""Where a step's time goes on the GPU (run on the lent H200 by scripts/gpu_round.sh).

    python3 scripts/gpu_profile.py random:smollm2-135m 64

1. TTFT of one 2000-token prompt, fresh each time (no prefix caching): wall time and the
   CUDA kernels' time (torch.profiler), to see whether prefill is the GPU or the host.
2. Decode steps of a batch, plain loop, under cProfile on the calling thread: the host's
   share, function by function.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from shoal import LLM, SamplingParams
from shoal.request import NewRequest


def main(model: str, batch: int) -> None:
    sp1 = SamplingParams(max_tokens=1)
    with LLM(model, device="cuda", max_batch_size=batch, max_num_tokens=16384,
             num_kv_blocks=batch * 48 + 256, enable_prefix_caching=False,
             overlap_scheduler=False) as llm:
        vocab = llm.engine.info.vocab_size
        g = torch.Generator().manual_seed(0)
        long_prompt = torch.randint(3, vocab, (2000,), generator=g).tolist()
        for i in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = llm.generate([long_prompt], sp1)[0]
            print(f"ttft run {i}: {out.metrics.ttft_s:.4f} s (wall {time.perf_counter() - start:.4f})")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate([long_prompt], sp1)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))

        engine = llm.engine
        prompts = [torch.randint(3, vocab, (512,), generator=g).tolist() for _ in range(batch)]
        for p in prompts:
            engine.add(NewRequest(p, SamplingParams(max_tokens=40, ignore_eos=True)))
        while engine.num_forward_passes < 3:  # the prefills
            engine.step()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        start, steps = time.perf_counter(), 0
        profiler.enable()
        while steps < 20:
            engine.step()
            steps += 1
        profiler.disable()
        torch.cuda.synchronize()
        print(f"decode: {1e3 * (time.perf_counter() - start) / steps:.2f} ms/step at batch "
              f"{batch} (graph replays: {getattr(engine.runner.graphs, 'num_replays', None)})")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        while engine.has_work:
            engine.step()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
