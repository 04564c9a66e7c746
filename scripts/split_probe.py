"""The timeline of one pool hit computed from the front while the back loads, on the GPU:
each engine step (its length, the tokens the request's front computed), each planner
decision (admission and the front's steps) and each load progress poll.

    PYTHONPATH=$PWD python3 scripts/split_probe.py random:llama-8b 8192 64

As `shoal bench ttft` runs it: an engine computes and saves the prompt, a load-only
engine teaches the rates (kept for the next engine), then the traced engine's hit.
"""
import os
import sys
import time

from shoal import LLM
from shoal.bench.ttft import ONE, _prompt, bench_pool
from shoal.connectors.store.worker import StoreWorker
from shoal.engine.engine import Engine
from shoal.engine.load_split import LoadPlanner
from shoal.util import cdiv

model, n = sys.argv[1], int(sys.argv[2])
bs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
kw = dict(device=os.environ.get("DEVICE", "cuda"), block_size=bs, max_num_tokens=max(n, 2048),
          enforce_eager=True, num_kv_blocks=cdiv(n, bs) + 64)
events: list[tuple[float, str]] = []
tracing = False


def trace(cls, name, show):
    original = getattr(cls, name)

    def traced(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        if tracing:
            events.append((start, f"{name} {show(self, args, out)} "
                                  f"({(time.perf_counter() - start) * 1e3:.1f} ms)"))
        return out
    setattr(cls, name, traced)


trace(LoadPlanner, "admit", lambda p, a, out: f"blocks {a[:2]} -> load_from {out.load_from} "
      f"first {out.first} (C {p.prefill_tps.value:.0f}, L {p.load_tps.value}, F "
      f"{p.load_latency_s.value}, overhead {p.prefill_overhead_s:.4f})")
trace(LoadPlanner, "front_step", lambda p, a, out: f"front {a[0]} writes_from {a[1]} "
      f"landed_from {a[2]} end {a[3]} -> {out}")
trace(StoreWorker, "get_load_progress", lambda w, a, out: f"{ {k: v for k, v in out.items()} }")
trace(Engine, "step", lambda e, a, out: f"-> {sum(map(len, out.new_tokens.values()))} new "
      f"tokens, {e.stats()['prompt_tokens']} prompt tokens computed so far")

with bench_pool(None) as connector:
    with LLM(model, kv_connector=connector(), **kw) as llm:
        prompt = _prompt(llm, n)
        llm.generate([prompt], ONE)
    for name, extra in (("load whole", dict(compute_while_loading=False)), ("split", {}),
                        ("split again", {})):
        with LLM(model, kv_connector=connector(**extra), **kw) as llm:
            events.clear()
            tracing = True
            t0 = time.perf_counter()
            out = llm.generate([prompt], ONE)[0]
            tracing = False
            print(f"== {name}: TTFT {out.metrics.ttft_s:.4f} s, hit {out.pool_hit}")
            for t, what in sorted(events):
                print(f"  {(t - t0) * 1e3:8.1f} ms  {what}")
