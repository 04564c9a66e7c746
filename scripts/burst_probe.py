"""First touches of several pooled documents at once, in a fresh engine: `shoal bench
serve`'s warm restart without the server (issue 25: four 1B-shape 8k documents were slower
from the pool than recomputed, 0.560 s against 0.307 s, on an H100).

    PYTHONPATH=$PWD python3 scripts/burst_probe.py random:llama-1b 8192 4 [ROUNDS [BS]]

An engine computes and saves DOCS random documents of N tokens; then, each in a fresh
engine and after one short warm request (as a server's first requests follow its
bring-up), the documents are submitted at once: with no pool (recomputed), and from the
pool (each engine's first hit). Then the same with one document alone. Printed per run:
each request's TTFT, its hit's decision and split, the engine's bytes loaded, the wall;
TRACE=1: also the timeline of the pool engines (admissions, each front's steps, the loads'
progress, each step's tokens and length).
"""
import os
import sys
import time

import torch

from shoal import LLM, SamplingParams
from shoal.bench.ttft import bench_pool
from shoal.engine.engine import Engine
from shoal.engine.transfers import KVTransfers

ONE = SamplingParams(max_tokens=1)
model, n, docs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
bs = int(sys.argv[5]) if len(sys.argv) > 5 else 16
device = os.environ.get("DEVICE", "cuda")
kw = dict(device=device, block_size=bs, num_kv_blocks=16384 if device == "cuda" else 4096)


TRACE = bool(os.environ.get("TRACE"))
events: list[tuple[float, str]] = []


def traced(cls, name, show):
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        shown = show(self, args, out) if TRACE else None
        if shown:
            events.append((start, f"{shown} ({(time.perf_counter() - start) * 1e3:.1f} ms)"))
        return out
    setattr(cls, name, wrapper)


def short(rid: str) -> str:
    return rid[-4:]


def show_front(t, args, out):
    load = t._loads.get(args[0].request_id)
    return (f"front {short(args[0].request_id)} at {args[0].num_computed_tokens} -> {out} "
            f"(landed_from {load.landed_from}, dropped_to {load.dropped_to})"
            if load is not None and load.is_planned else None)


def show_apply(t, args, out):
    report = args[1]
    moved = {short(r): (p.writes_from, p.landed_from) for r, p in report.progress.items()}
    done = [short(r) for r in report.finished_loading]
    return f"progress {moved} done {done}" if moved or done else None


traced(KVTransfers, "admit", lambda t, a, out: f"admit {short(a[0].request_id)}: "
       f"{a[0].pool_hit.decision if a[0].pool_hit else None}, load from block "
       f"{t._loads[a[0].request_id].dropped_to if out else '-'}" if a[2] else None)
traced(KVTransfers, "front_tokens", show_front)
traced(KVTransfers, "apply", show_apply)
traced(Engine, "step", lambda e, a, out: f"step: {sum(map(len, out.new_tokens.values()))} "
       f"new tokens, {e.stats()['prompt_tokens']} prompt tokens so far")


def prompts(llm: LLM, count: int, seed: int = 0) -> list[list[int]]:
    vocab = llm.engine.info.vocab_size
    return [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed + i)
                          ).tolist() for i in range(count)]


def burst(llm: LLM, batch: list[list[int]], label: str) -> None:
    llm.generate([prompts(llm, 1, seed=10_000 + int(time.time()))[0][:64]], ONE)  # warm
    before = llm.stats()
    start = time.perf_counter()
    handles = [llm.submit(p, ONE) for p in batch]
    outs = [h.result() for h in handles]
    wall = time.perf_counter() - start
    after = llm.stats()
    loaded = after.get("bytes_loaded", 0) - before.get("bytes_loaded", 0)
    rows = []
    for out in outs:
        hit = out.pool_hit
        rows.append(f"{out.metrics.ttft_s:.3f}" + (
            f" {hit.decision} front {hit.num_front_tokens} loaded {hit.num_loaded_tokens}"
            f" (C {hit.prefill_tokens_per_s:.0f} L {hit.load_tokens_per_s:.0f}"
            f" F {hit.load_latency_s:.4f})" if hit else ""))
    print(f"== {label}: wall {wall:.3f} s, {loaded / 1e6:.0f} MB loaded, forwards "
          f"{after['forward_passes'] - before['forward_passes']}", flush=True)
    for row in rows:
        print("   ttft", row, flush=True)
    for at, what in events:
        if at >= start:
            print(f"   {(at - start) * 1e3:8.1f} ms  {what}")
    events.clear()


with bench_pool(None) as connector:
    with LLM(model, kv_connector=connector(), **kw) as llm:
        everything = prompts(llm, docs)
        llm.generate(everything, ONE)  # computed and saved
    for r in range(rounds):
        for batch, what in ((everything, f"{docs} at once"), (everything[:1], "one alone")):
            with LLM(model, **kw) as llm:
                burst(llm, batch, f"round {r}, {what}, recomputed")
            with LLM(model, kv_connector=connector(), **kw) as llm:
                burst(llm, batch, f"round {r}, {what}, from the pool")
            with LLM(model, kv_connector=connector(compute_while_loading=False), **kw) as llm:
                burst(llm, batch, f"round {r}, {what}, from the pool, loaded whole")
