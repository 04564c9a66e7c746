"""Where a GPU load's time goes, piece by piece: the GPU checksum of read blocks, one raw
pinned host-to-device copy of a load's bytes, and PagedMover.load of blocks the host tier
holds (staged) and of blocks read from host memory (verified on the GPU), by thread count.

    [PROFILE=1] PYTHONPATH=$PWD python3 scripts/mover_probe.py [BLOCK_MB ...]

BLOCK_MB may be a fraction (0.5: Llama-1B's 16-token block). PROFILE=1: one more load from
"files" at 1 and 8 threads under torch.profiler (the host's CPU and CUDA runtime calls),
its busiest calls printed: where a chunk's copies and checks spend the host's time.

Llama-8B's 8k-token prefix is 1 GiB: 128 blocks of 8 MiB (64 tokens), 512 of 2 MiB (16).
An old checksum module at scripts/_old_xxh3.py (if present) is timed beside the current.
"""
import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from shoal.connectors.store import gpu_xxh3
from shoal.connectors.store.host_tier import HostTier, tier_shape
from shoal.connectors.store.paged_io import PagedMover

TOTAL = 1 << 30
dev = torch.device("cuda")


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def hashes(block_mb: float) -> None:
    mods = {"now": gpu_xxh3}
    old = os.path.join(os.path.dirname(__file__), "_old_xxh3.py")
    if os.path.exists(old):
        spec = importlib.util.spec_from_file_location("old_xxh3", old)
        mods["old"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods["old"])
    nbytes = int(block_mb * (1 << 20))
    for rows in (1, max(1, int(16 // block_mb)), 8):
        data = torch.randint(-2**62, 2**62, (rows, nbytes // 8), dtype=torch.int64, device=dev)
        ids = torch.arange(rows, device=dev)
        want = torch.tensor([gpu_xxh3.signed(xxhash.xxh3_64_intdigest(
            data[i].cpu().numpy().tobytes())) for i in range(rows)], device=dev)
        for name, mod in mods.items():
            s = timed(lambda: mod.verify_rows(data, ids, want))
            ok = mod.verify_rows(data, ids, want)[1].tolist()
            print(f"checksum {name}: {rows} x {block_mb} MiB in {s * 1e3:.3f} ms "
                  f"({rows * nbytes / s / 1e9:.1f} GB/s) ok={all(ok)}")


def copies(block_mb: float) -> None:
    nbytes = int(block_mb * (1 << 20))
    n = TOTAL // nbytes
    kv = torch.zeros((n + 8, nbytes // 2), dtype=torch.bfloat16, device=dev)
    pages, per_page = tier_shape(2 * TOTAL, nbytes, 4 * 9)
    tier = HostTier(nbytes, pages, per_page, pinned=True)
    src = torch.randint(0, 255, (n, nbytes), dtype=torch.uint8).pin_memory()
    dst = torch.empty((n, nbytes), dtype=torch.uint8, device=dev)
    s = timed(lambda: dst.copy_(src, non_blocking=True))
    print(f"raw H2D, one copy: {TOTAL / s / 1e9:.1f} GB/s ({s * 1e3:.1f} ms)")

    def per_page_copies():
        for i in range(0, n, per_page):
            dst[i:i + per_page].copy_(src[i:i + per_page], non_blocking=True)
    s = timed(per_page_copies)
    print(f"raw H2D, a copy per page ({per_page} blocks): {TOTAL / s / 1e9:.1f} GB/s")
    mover = PagedMover(kv, tier)
    mover.warm_up()
    keys = [os.urandom(32) for _ in range(n)]
    host = src.numpy()
    sums = [xxhash.xxh3_64_intdigest(host[i].tobytes()) for i in range(n)]
    bad = []

    def read(i, dest):  # a read from the page cache: a copy from host memory
        np.copyto(np.frombuffer(dest, dtype=np.uint8), host[i])
        return sums[i]

    units = [list(range(i, min(n, i + per_page))) for i in range(0, n, per_page)]

    def load(pool):
        list(pool.map(lambda u: mover.load([keys[j] for j in u], [j + 4 for j in u],
                                           lambda k, d, u=u: read(u[k], d), bad.append),
                      units))
    for threads in (1, 4, 8):
        pool = ThreadPoolExecutor(threads)
        for _ in range(3):  # each time from "files": the tier forgets what it holds
            tier.__init__(nbytes, pages, per_page, pinned=True)
            mover = PagedMover(kv, tier)
            torch.cuda.synchronize()
            start = time.perf_counter()
            load(pool)
            s = time.perf_counter() - start
        print(f"mover, read + GPU check, {threads} threads: {TOTAL / s / 1e9:.1f} GB/s "
              f"({s * 1e3:.1f} ms), corrupt {len(bad)}")
        if os.environ.get("PROFILE") and threads in (1, 8):
            from torch.profiler import ProfilerActivity, profile
            tier.__init__(nbytes, pages, per_page, pinned=True)
            mover = PagedMover(kv, tier)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                load(pool)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                            max_name_column_width=48))
        pool.shutdown()
    ok = torch.equal(kv[4:n + 4].view(torch.uint8).reshape(n, -1)[:, :16].cpu(),
                     src[:, :16])
    print("placed bytes equal:", ok)
    for threads in (1,):
        torch.cuda.synchronize()
        start = time.perf_counter()
        mover.load(keys, [j + 4 for j in range(n)], lambda k, d: None, bad.append)
        s = time.perf_counter() - start
        print(f"mover, all from the tier, 1 thread: {TOTAL / s / 1e9:.1f} GB/s "
              f"({s * 1e3:.1f} ms), tier hits {tier.num_hits}")


for mb in [float(a) for a in sys.argv[1:]] or [8, 2]:
    print(f"== {mb} MiB blocks")
    hashes(mb)
    copies(mb)
