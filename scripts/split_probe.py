"""The timeline of one pool hit computed from the front while the back loads, on the GPU:
each engine step (its length, the tokens the request's front computed), each planner
decision (admission and the front's steps) and each load progress poll.

    [IO_THREADS=N] [POLL=S] [SWITCH=S] [WHOLE=N] [GATE=S] [BLOCKING=0] PYTHONPATH=$PWD \
        python3 scripts/split_probe.py random:llama-8b 8192 64 [files|tier]

BASELINE=1: first a traced run of an engine with no pool (the recompute). READ_PROCS=N: the fs pool's read_processes; IO_TRACE=1: each load unit's time on its I/O thread, split into reading files, launching
copies (with the gate's wait) and waiting for them.
POLL: the engine's longest wait while it only waits for loads (engine.IDLE_WAIT_SECONDS); SWITCH:
`sys.setswitchinterval` (how long a thread running Python keeps the GIL from a thread back
from I/O); WHOLE=N: only N engines that load whole (no split); GATE: the longest a chunk
read from files holds its copies back while a forward is launched (paged_io.LAUNCH_WAIT_S;
0: never); BLOCKING=0: the I/O threads wait for their copies spinning in the driver
(paged_io.BLOCKING_WAITS).

As `shoal bench ttft` runs it: an engine computes and saves the prompt, a load-only
engine teaches the rates (kept for the next engine), then the traced engine's hit. With
`tier`, each engine first computes and saves the prompt under a fresh salt, then the traced
request (same salt) hits the blocks its host tier kept. Also traced: the pool lookup, the
start of loads, the polls that report loads finished, each forward.
"""
import gc
import os
import statistics
import sys
import time

import torch

from shoal import LLM
from shoal.bench.ttft import ONE, _prompt, bench_pool
from shoal.connectors.store import paged_io
from shoal.connectors.store.worker import StoreWorker
from shoal.engine.cuda_graphs import StepGraphs
from shoal.engine.engine import Engine
from shoal.connectors.store.scheduler import StoreScheduler
from shoal.engine.load_split import LoadPlanner
from shoal.engine.model_runner import ModelRunner
from shoal.sampling import Sampler
from shoal.util import cdiv

model, n = sys.argv[1], int(sys.argv[2])
bs = int(sys.argv[3]) if len(sys.argv) > 3 else 16
source = sys.argv[4] if len(sys.argv) > 4 else "files"
kw = dict(device=os.environ.get("DEVICE", "cuda"), block_size=bs, max_num_tokens=max(n, 2048),
          max_batch_size=1, num_kv_blocks=cdiv(n, bs) + 64,
          enable_prefix_caching=source != "tier")
events: list[tuple[float, str]] = []
units: list[dict[str, float]] = []  # (IO_TRACE) each load unit's times, in seconds
# (IO_TRACE) each read process share's (blocks, ms): from the I/O thread's send to its
# receipt of the answer (the process's reads, and any wait of that thread for the GIL)
shares: list[tuple[int, float]] = []
tracing = False


def trace(cls, name, show):
    original = getattr(cls, name)

    def traced(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        shown = show(self, args, out) if tracing else None
        if shown is not None:
            events.append((start, f"{name} {shown} "
                                  f"({(time.perf_counter() - start) * 1e3:.1f} ms)"))
        return out
    setattr(cls, name, traced)


trace(LoadPlanner, "admit", lambda p, a, out: f"blocks {a[:2]} -> load_from {out.load_from} "
      f"first {out.first} (C {p.prefill_tps.value:.0f}, L {p.load_tps.value}, F "
      f"{p.load_latency_s.value}, overhead {p.prefill_overhead_s:.4f}, launch {p.prefill_launch_s:.4f})")
trace(LoadPlanner, "front_step", lambda p, a, out: f"front {a[0]} landed_from {a[1]} "
      f"end {a[2]} -> {out}")
trace(StoreWorker, "get_load_progress", lambda w, a, out: f"{ {k: v for k, v in out.items()} }")
trace(StoreScheduler, "get_num_new_matched_tokens", lambda s, a, out: f"lookup -> {out}")
trace(StoreWorker, "start_load_kv", lambda w, a, out: f"{len(m.loads)} blocks"
      if (m := w.get_connector_meta()) and m.loads else None)
trace(StoreWorker, "get_finished", lambda w, a, out: f"loads done {sorted(out[1])}"
      if out[1] else None)
gpu_spans: list[tuple[int, object, object]] = []  # (index in events, start, end) of forwards


def traced_execute(original):
    def execute(self, *args, **kwargs):
        if not (tracing and torch.cuda.is_available()):
            return original(self, *args, **kwargs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        end.record()
        events.append((start, f"execute: forward of {args[0].num_tokens} tokens launched in "
                              f"{(time.perf_counter() - start) * 1e3:.1f} ms"))
        gpu_spans.append((len(events) - 1, begin, end))
        return out
    return execute


ModelRunner.execute = traced_execute(ModelRunner.execute)
# the tail's host time after a load (1.1-2.2 ms on an H100 where chunk_probe's replay took
# 0.3 ms): its pieces, and any collection the garbage collector ran meanwhile
trace(StepGraphs, "prepare", lambda g, a, out: f"graph inputs of {a[1].num_tokens} tokens")
trace(Sampler, "sample_on_device", lambda s, a, out: f"{a[0].shape[0]} rows")
gc_started: list[float] = []


def on_gc(phase, info):
    if not tracing:
        return
    if phase == "start":
        gc_started.append(time.perf_counter())
    elif gc_started:
        start = gc_started.pop()
        events.append((start, f"gc of generation {info['generation']} "
                              f"({(time.perf_counter() - start) * 1e3:.1f} ms)"))


gc.callbacks.append(on_gc)
if os.environ.get("EXTRA_TRACE"):  # the engine's own steps before the load starts
    from shoal.engine.scheduler import Scheduler
    from shoal.engine.transfers import KVTransfers
    trace(Engine, "add", lambda e, a, out: "add")
    trace(Scheduler, "schedule", lambda s, a, out: "schedule")
    trace(KVTransfers, "admit", lambda t, a, out: "transfers.admit")
    trace(KVTransfers, "match", lambda t, a, out: "transfers.match")
    trace(Engine, "_execute", lambda e, a, out: "engine._execute")
forwards_seen: dict[int, int] = {}


def show_step(engine, args, out):
    """A step that ran a forward (a step that only polled loads: None)."""
    forwards = engine.stats()["forward_passes"]
    if forwards == forwards_seen.get(id(engine)):
        return None
    forwards_seen[id(engine)] = forwards
    return (f"-> {sum(map(len, out.new_tokens.values()))} new tokens, "
            f"{engine.stats()['prompt_tokens']} prompt tokens computed so far")


trace(Engine, "step", show_step)

import shoal.engine.engine as engine_module  # noqa: E402
engine_module.IDLE_WAIT_SECONDS = float(os.environ.get("POLL", engine_module.IDLE_WAIT_SECONDS))
if "SWITCH" in os.environ:
    sys.setswitchinterval(float(os.environ["SWITCH"]))
if os.environ.get("IO_TRACE"):  # where an I/O thread's time goes, unit by unit
    import threading
    from shoal.connectors.store.paged_io import PagedMover
    io_local = threading.local()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = getattr(io_local, "spent", None)
                if spent is not None:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return wrapper
    for name in ("_copy_in", "_finish"):
        setattr(PagedMover, name, timed(name, getattr(PagedMover, name)))
    original_load = PagedMover.load

    def traced_load(self, keys, block_ids, read, corrupt, after=None, read_many=None):
        io_local.spent = {}
        start = time.perf_counter()
        try:
            return original_load(self, keys, block_ids, timed("read", read), corrupt, after,
                                 read_many and timed("read_many", read_many))
        finally:
            spent, io_local.spent = io_local.spent, None
            if tracing:
                units.append({"unit": time.perf_counter() - start, **spent})
                parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in spent.items())
                events.append((start, f"unit of {len(keys)} blocks on "
                                      f"{threading.current_thread().name}: "
                                      f"{(time.perf_counter() - start) * 1e3:.1f} ms ({parts})"))
    PagedMover.load = traced_load
    # each read process's share: sent (keys, first row, verify), answered with a list
    from multiprocessing.connection import Connection
    sent_at: dict[int, tuple[float, int]] = {}
    original_send, original_recv = Connection.send, Connection.recv

    def traced_send(self, obj):
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], list):
            sent_at[self.fileno()] = (time.perf_counter(), len(obj[0]))
        return original_send(self, obj)

    def traced_recv(self):
        out = original_recv(self)
        share = sent_at.pop(self.fileno(), None) if isinstance(out, list) else None
        if share is not None and tracing:
            ms = (time.perf_counter() - share[0]) * 1e3
            shares.append((share[1], ms))
            events.append((share[0], f"share of {share[1]} blocks on fd {self.fileno()}: "
                                     f"{ms:.1f} ms"))
        return out
    Connection.send, Connection.recv = traced_send, traced_recv
paged_io.LAUNCH_WAIT_S = float(os.environ.get("GATE", paged_io.LAUNCH_WAIT_S))
paged_io.BLOCKING_WAITS = os.environ.get("BLOCKING", "1") != "0"
modes = ((("load whole", dict(compute_while_loading=False)),) * int(os.environ["WHOLE"])
         if "WHOLE" in os.environ else
         (("load whole", dict(compute_while_loading=False)), ("split", {}), ("split again", {})))
if os.environ.get("BASELINE"):  # first, the prompt recomputed by an engine with no pool
    modes = (("no pool", None),) + modes
options = {"io_threads": int(os.environ["IO_THREADS"])} if "IO_THREADS" in os.environ else {}
if "READ_PROCS" in os.environ:  # the fs pool's read processes (0: the I/O threads read)
    options["read_processes"] = int(os.environ["READ_PROCS"])
if "TIER_BYTES" in os.environ:  # (a CPU run goes through the tier's pages with one)
    options["host_tier_bytes"] = int(os.environ["TIER_BYTES"])
with bench_pool(None, **options) as connector:
    with LLM(model, kv_connector=connector(), **kw) as llm:
        prompt = _prompt(llm, n)
        llm.generate([prompt], ONE)
    for name, extra in modes:
        with LLM(model, kv_connector=extra if extra is None else connector(**extra),
                 **kw) as llm:
            calls = llm.engine.transfers.calls if llm.engine.transfers else None
            readers = getattr(calls and calls.worker.store, "_readers", None)
            if readers is not None:  # (as in a server: its processes started long before)
                print(f"read processes ready: {readers.wait_ready(60)}")
            salt = os.urandom(8).hex() if source == "tier" else None
            if salt:  # computed and saved: the tier keeps what it saved
                llm.generate([prompt], ONE, cache_salt=salt)
            events.clear()
            tracing = True
            t0 = time.perf_counter()
            out = llm.generate([prompt], ONE, cache_salt=salt)[0]
            tracing = False
            print(f"== {name}: TTFT {out.metrics.ttft_s:.4f} s, hit {out.pool_hit}")
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            for i, begin, end in gpu_spans:  # the GPU's time from launch start to its end
                t, what = events[i]
                events[i] = (t, f"{what}, on the GPU {begin.elapsed_time(end):.1f} ms "
                                f"from its launch")
            gpu_spans.clear()
            for t, what in sorted(events):
                print(f"  {(t - t0) * 1e3:8.1f} ms  {what}")
            if units:  # (IO_TRACE) the medians of this engine's units, in ms
                medians = {k: statistics.median(u.get(k, 0.0) for u in units) * 1e3
                           for k in sorted({k for u in units for k in u})}
                print(f"   {len(units)} units, medians: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
                units.clear()
            if shares:  # (IO_TRACE) this engine's read process shares, slowest first
                per_block = sorted(ms / n for n, ms in shares)
                print(f"   {len(shares)} shares, ms a block: min {per_block[0]:.2f}, median "
                      f"{statistics.median(per_block):.2f}, max {per_block[-1]:.2f}; slowest "
                      f"(blocks, ms): {sorted(shares, key=lambda x: -x[1])[:3]}")
                shares.clear()
