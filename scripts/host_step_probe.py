"""The engine's host work per decode step, apart from the model: a one-layer model with a
512-token vocabulary on the CPU, so that a step is almost all Python (the scheduler, the
inputs, the update, the report). Prints ms per decode step, in the overlap loop and the
plain one, and with PROFILE=1 the functions that take the most of the plain loop's time
(cProfile, self time; the engine's thread only).

    .venv/bin/python scripts/host_step_probe.py [num_prompts=256] [rounds=3] [device=cpu]

On a GPU (device cuda: decode steps replay CUDA graphs) the model's work is a few
microseconds, so the step is the host's floor: what a step of a real shape at this batch
cannot go below (docs/roadmap.md item 1)."""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.request import NewRequest
from shoal.sampling import SamplingParams


def tiny_checkpoint(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def main(num_prompts: int = 256, rounds: int = 3, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    new_tokens = 64
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(Path(tmp) / "tiny")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 512, (32,), generator=g).tolist() for _ in range(num_prompts)]
        for overlap in (True, False):
            engine = Engine(EngineConfig(model=str(model), max_batch_size=num_prompts,
                                         max_num_tokens=max(2048, 32 * num_prompts),
                                         overlap_scheduler=overlap, device=device))
            profile = cProfile.Profile() if os.environ.get("PROFILE") and not overlap else None
            for _ in range(rounds):
                for prompt in prompts:
                    engine.add(NewRequest(prompt, SamplingParams(max_tokens=new_tokens,
                                                                 ignore_eos=True)))
                engine.step()  # the prefill
                steps, start = 0, time.perf_counter()
                if profile is not None:
                    profile.enable()
                while engine.has_work:
                    engine.step()
                    steps += 1
                if profile is not None:
                    profile.disable()
                seconds = time.perf_counter() - start
                print(f"overlap {overlap}, {num_prompts} rows: {1e3 * seconds / steps:.2f} ms "
                      f"a step ({steps} steps)")
            engine.shutdown()
            if profile is not None:
                pstats.Stats(profile).sort_stats("tottime").print_stats(35)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
