"""What a process's first pool load pays once, on the GPU: the Triton kernels each phase
compiles (a fresh Triton cache) and each phase's time.

    PYTHONPATH=$PWD python3 scripts/first_load_probe.py random:deepseek-v2-lite@9 8192

Phases, each a fresh engine on one prompt of N tokens, in one process: compute and save,
load whole (compute_while_loading=False), load whole again, recompute (no pool). A phase
that compiles a kernel the first phase did not is a one-time cost a request pays. During
each request a thread samples every thread's stack every 20 ms; a request over 0.3 s prints
where the busy threads' samples fell (their innermost three frames, most frequent first).
"""
import collections
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-probe-")

from shoal import LLM  # noqa: E402
from shoal.bench.ttft import ONE, _prompt, bench_pool  # noqa: E402
from shoal.util import cdiv  # noqa: E402

model, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8192
kw = dict(device=os.environ.get("DEVICE", "cuda"), max_num_tokens=max(n, 2048), enforce_eager=True,
          num_kv_blocks=cdiv(n, 16) + 64)
cache = Path(os.environ["TRITON_CACHE_DIR"])
seen: set[str] = set()


def compiled() -> list[str]:
    names = {p.stem for p in cache.glob("*/*.json") if not p.name.startswith("__grp__")}
    new = sorted(names - seen)
    seen.update(names)
    return new


class StackSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.counts, self.stop = collections.Counter(), threading.Event()

    def run(self):
        names = {t.ident: t.name for t in threading.enumerate()}
        while not self.stop.wait(0.02):
            for ident, frame in sys._current_frames().items():
                if ident == self.ident or frame.f_code.co_filename.endswith("threading.py"):
                    continue  # (a thread waiting on a lock or a condition: idle)
                where = []
                while frame is not None and len(where) < 3:
                    code = frame.f_code
                    where.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                thread = names.get(ident) or next((t.name for t in threading.enumerate()
                                                   if t.ident == ident), str(ident))
                self.counts[(thread.split("_")[0], " < ".join(where))] += 1


with bench_pool(None) as connector:
    phases = [("compute + save", dict(kv_connector=connector())),
              ("load whole", dict(kv_connector=connector(compute_while_loading=False))),
              ("load whole again", dict(kv_connector=connector(compute_while_loading=False))),
              ("recompute", {})]
    prompt = None
    for name, extra in phases:
        t0 = time.perf_counter()
        with LLM(model, **kw, **extra) as llm:
            up = time.perf_counter() - t0
            built = compiled()
            prompt = prompt or _prompt(llm, n)
            sampler = StackSampler()
            sampler.start()
            out = llm.generate([prompt], ONE)[0]
            sampler.stop.set()
            print(f"{name:18s} bring-up {up:6.2f} s (compiled {built}); TTFT "
                  f"{out.metrics.ttft_s:.4f} s, {out.num_connector_tokens} tokens loaded; "
                  f"compiled in the request: {compiled()}", flush=True)
            if out.metrics.ttft_s > 0.3:
                for (thread, where), k in sampler.counts.most_common(12):
                    print(f"    {k:4d} x {thread}: {where}")
