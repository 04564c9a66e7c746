"""The engine's Python per row of a decode step, counted rather than timed: the bytecode
instructions the interpreter runs (sys.settrace with opcode events), per row and step, in
all and by function. A shared CPU's speed drifts by tens of percent from one minute to the
next; this count does not, so it compares two versions of the host code exactly (C work,
numpy's and torch's, is not in it).

    .venv/bin/python scripts/step_opcodes.py [num_prompts=256] [plain|overlap] [top=12]

A one-layer model (host_step_probe.py's) whose forward and logits are replaced by zeros, on
the CPU, the plain loop by default. With `overlap` only the engine's own thread is counted
(the forward thread started before the count). With TIME=1 nothing is counted: it prints
the wall time of a decode step instead, the fastest of 6 rounds' means."""

from __future__ import annotations

import collections
import os
import sys
import time
import tempfile
from pathlib import Path

import torch

from host_step_probe import tiny_checkpoint
from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.model import llama
from shoal.request import NewRequest
from shoal.sampling import SamplingParams


def main(num_prompts: int = 256, loop: str = "plain", top: int = 12) -> None:
    # the model's work is not the engine's: zeros of the right shapes
    llama.LlamaModel.forward = lambda self, ids, *a, **k: torch.zeros(ids.shape[0], 64)
    llama.LlamaModel.compute_logits = lambda self, h: torch.zeros(h.shape[0], 512)
    by_function: collections.Counter = collections.Counter()

    def count(frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            by_function[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return count

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        return count

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_checkpoint(Path(tmp) / "tiny")
        g = torch.Generator().manual_seed(0)
        engine = Engine(EngineConfig(model=str(model), max_batch_size=num_prompts,
                                     max_num_tokens=max(2048, 32 * num_prompts),
                                     overlap_scheduler=loop == "overlap"))
        prompts = [torch.randint(3, 512, (32,), generator=g).tolist() for _ in range(num_prompts)]
        if os.environ.get("TIME") == "1":
            print(f"{loop} loop, {num_prompts} rows: {1e3 * wall_step(engine, prompts):.3f} ms "
                  f"a decode step (the fastest of 6 rounds' means)")
            return engine.shutdown()
        for prompt in prompts:
            engine.add(NewRequest(prompt, SamplingParams(max_tokens=64, ignore_eos=True)))
        for _ in range(3):  # the prefill, then decodes
            engine.step()
        steps = 40  # (a block of 16 tokens completes in them, twice)
        sys.settrace(trace)
        for _ in range(steps):
            engine.step()
        sys.settrace(None)
        engine.shutdown()
    per_row = steps * num_prompts
    print(f"{loop} loop, {num_prompts} rows: {sum(by_function.values()) / per_row:.1f} "
          f"opcodes a row a step")
    for name, n in by_function.most_common(top):
        print(f"  {n / per_row:7.1f}  {name}")


def wall_step(engine: Engine, prompts: list[list[int]], rounds: int = 6) -> float:
    """Seconds a decode step of the whole batch takes: the fastest round's mean (each round
    under a cache salt of its own: no prefix hit)."""
    best = float("inf")
    for i in range(rounds):
        for prompt in prompts:
            engine.add(NewRequest(prompt, SamplingParams(max_tokens=64, ignore_eos=True),
                                  cache_salt=f"round-{i}"))
        for _ in range(2):  # the prefill, applied by the second step in the overlap loop
            engine.step()
        steps, start = 0, time.perf_counter()
        while engine.has_work:
            engine.step()
            steps += 1
        best = min(best, (time.perf_counter() - start) / steps)
    return best


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]), *sys.argv[2:3], *(int(a) for a in sys.argv[3:4]))
