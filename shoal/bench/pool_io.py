"""`shoal bench pool-io`: the fs connector's save and load GB/s vs raw file writes and reads
of the same bytes with the same number of threads, in one run."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shoal.connectors import ConnectorConfig, ConnectorContext, KVCacheRegistration
from shoal.connectors.fs.connector import BlockTransfer, FsPoolMeta, FsPoolWorker
from shoal.kv.kv_cache import KVCacheLayout


def _transfer(worker: FsPoolWorker, meta: FsPoolMeta, rid: str, saving: bool) -> float:
    start = time.perf_counter()
    worker.bind_connector_meta(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_meta()
    while True:
        saved, loaded = worker.get_finished([rid] if saving else [], [] if saving else [rid])
        if (saved if saving else loaded):
            return time.perf_counter() - start
        time.sleep(0.0002)


def _raw(paths: list[Path], views: list[memoryview], threads: int, write: bool) -> float:
    def one(i: int) -> None:
        if write:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb", buffering=0) as f:
                f.write(views[i])
        else:
            with open(paths[i], "rb", buffering=0) as f:
                f.readinto(views[i])
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths))))
    return time.perf_counter() - start


def run_pool_io(num_blocks: int, threads: int, rounds: int) -> int:
    # SmolLM2's block: 30 layers x (k, v) x 16 tokens x 3 KV heads x 64 dims, float32
    layout = KVCacheLayout(num_blocks, 30, 16, 3, 64, torch.float32)
    kv = torch.randn((num_blocks, *layout.block_shape))
    nbytes = num_blocks * layout.block_nbytes
    results = {"save": [], "raw_write": [], "load": [], "raw_read": []}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-io-") as tmp:
        for r in range(rounds):  # each round: a fresh pool, fresh raw files
            root = Path(tmp) / f"pool{r}"
            cfg = ConnectorConfig(name="fs", options={"root": str(root), "io_threads": threads})
            ctx = ConnectorContext(0, 1, 0, 1, 0, 1, 16, os.urandom(32).hex(), "cpu")
            worker = FsPoolWorker(cfg, ctx)
            worker.register_kv_caches(KVCacheRegistration(kv, layout))
            blocks = [BlockTransfer("r", i, i, os.urandom(32)) for i in range(num_blocks)]
            raw_dir = Path(tmp) / f"raw{r}"
            raw_dir.mkdir()
            paths = [raw_dir / f"{i}.bin" for i in range(num_blocks)]
            views = [memoryview(kv[i].reshape(-1).view(torch.uint8).numpy()) for i in range(num_blocks)]
            # alternate which goes first: page-cache writeback of the first slows the second
            steps = [("save", lambda: _transfer(worker, FsPoolMeta(saves=blocks), "r", True)),
                     ("raw_write", lambda: _raw(paths, views, threads, write=True)),
                     ("load", lambda: _transfer(worker, FsPoolMeta(loads=blocks), "r", False)),
                     ("raw_read", lambda: _raw(paths, views, threads, write=False))]
            order = steps if r % 2 == 0 else [steps[1], steps[0], steps[3], steps[2]]
            for name, fn in order:
                results[name].append(fn())
            assert not worker.get_failed_loads(), "a load failed"
            worker.shutdown()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}
    result = {"bench": "pool-io", "num_blocks": num_blocks, "block_bytes": layout.block_nbytes,
              "threads": threads, "rounds": rounds, **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
              "save_over_raw": gbps["save"] / gbps["raw_write"],
              "load_over_raw": gbps["load"] / gbps["raw_read"]}
    print(f"{num_blocks} blocks of {layout.block_nbytes / 2**10:.0f} KiB "
          f"({nbytes / 2**20:.0f} MiB), {threads} threads, median of {rounds} rounds")
    print(f"  save {gbps['save']:6.2f} GB/s vs raw write {gbps['raw_write']:6.2f} GB/s: "
          f"{result['save_over_raw']:.2f}")
    print(f"  load {gbps['load']:6.2f} GB/s vs raw read  {gbps['raw_read']:6.2f} GB/s: "
          f"{result['load_over_raw']:.2f}   (goal >= 0.7 each)")
    print(json.dumps(result))
    return 0
