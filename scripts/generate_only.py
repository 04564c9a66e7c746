"""Shoal's `generate` alone on the throughput bench's prompts: tokens/s and decode ms per
step per round. For A/B runs of two trees in one call (run it once per tree, with
PYTHONPATH pointing at each):

    PYTHONPATH=$PWD python3 scripts/generate_only.py random:smollm2-135m 256 256 3
"""

from __future__ import annotations

import sys
import time

import torch

from shoal import LLM, SamplingParams
from shoal.kv.kv_cache_manager import cdiv


def main(model: str, num_prompts: int, prompt_len: int, rounds: int) -> None:
    sp = SamplingParams(max_tokens=128, ignore_eos=True)
    with LLM(model, device="cuda", max_batch_size=num_prompts, max_num_tokens=16384,
             num_kv_blocks=num_prompts * cdiv(prompt_len + 128, 16) + 64) as llm:
        g = torch.Generator().manual_seed(0)  # the prompts of `shoal bench throughput`
        vocab = llm.engine.info.vocab_size
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
                   for _ in range(num_prompts)]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        for _ in range(rounds):
            start = time.perf_counter()
            outs = llm.generate(prompts, sp)
            seconds = time.perf_counter() - start
            first = max(o.metrics.first_token_time for o in outs)
            end = max(o.metrics.finish_time for o in outs)
            print(f"{num_prompts * 128 / seconds:.0f} tok/s, decode {1e3 * (end - first) / 127:.2f} "
                  "ms/step")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
