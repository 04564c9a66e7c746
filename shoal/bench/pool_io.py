"""`shoal bench pool-io`: the fs connector's save and load GB/s against raw I/O of the same
bytes with the same number of threads, in one run.

CPU (the default): blocks of SmolLM2's shape in float32; raw = one file write / read per
block into the same memory. `--device cuda`: blocks of Llama-3.2-1B's shape in bfloat16 in
GPU memory; raw = the files read into one pinned buffer, then one host-to-device `copy_`
(for saves: one device-to-host `copy_`, then the files written), and the H2D copy alone
(the floor). Loads run from the page cache (the files were just written) and, on a GPU,
once more from the host tier. On a GPU it also times steps of GPU work with a page of
saves started after each and without, to show saves do not stall the forward.

Each round's pool starts with its 256 block directories (a pool in use has them) and the
bench waits for the connector as an idle engine does (`wait_for_transfers` between polls).
"""

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
from shoal.connectors.fs import format as pf
from shoal.connectors.fs.connector import BlockTransfer, FsPoolMeta, FsPoolWorker
from shoal.util import hand_over_the_gil_often
from shoal.engine.engine import IDLE_WAIT_SECONDS
from shoal.kv.kv_cache import KVCacheLayout


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


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
        worker.wait_for_transfers(IDLE_WAIT_SECONDS)  # as an engine that only waits for them


def _make_block_dirs(root: Path) -> None:
    """The 256 blocks/<xx> directories a pool in use has (a fresh pool makes each once, at
    its first save there: not a save's cost; the raw writes' directory exists too)."""
    pf.ensure_pool_dirs(root)
    for i in range(256):
        os.close(pf.open_pool_dir(root, "blocks", f"{i:02x}", create=True))


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


def _timed(fn, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run_pool_io(num_blocks: int, threads: int, rounds: int, device: str = "cpu") -> int:
    cuda = device.startswith("cuda")
    if cuda:  # Llama-3.2-1B: 16 layers x (k, v) x 16 tokens x 8 KV heads x 64 dims, bf16
        layout = KVCacheLayout(num_blocks, 16, 16, 8, 64, torch.bfloat16)
        hand_over_the_gil_often()  # as a GPU engine does
    else:  # SmolLM2: 30 layers x (k, v) x 16 tokens x 3 KV heads x 64 dims, float32
        layout = KVCacheLayout(num_blocks, 30, 16, 3, 64, torch.float32)
    kv = torch.randn((2 * num_blocks, *layout.block_shape), device=device).to(layout.dtype)
    original = kv[:num_blocks].clone()
    nbytes = num_blocks * layout.block_nbytes
    host = torch.empty((num_blocks, layout.block_nbytes), dtype=torch.uint8, pin_memory=cuda)
    host[:] = kv[:num_blocks].reshape(num_blocks, -1).view(torch.uint8).cpu()
    dev_bytes = kv.reshape(2 * num_blocks, -1).view(torch.uint8)
    views = [memoryview(host[i].numpy()) for i in range(num_blocks)]
    names = ["save", "raw_write", "load", "raw_read"] + (["load_tier", "h2d"] if cuda else [])
    results: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-io-") as tmp:
        for r in range(rounds):  # each round: a fresh pool, fresh raw files
            root = Path(tmp) / f"pool{r}"
            _make_block_dirs(root)
            cfg = ConnectorConfig(name="fs", options={"root": str(root), "io_threads": threads})
            ctx = ConnectorContext(0, 1, 0, 1, 0, 1, 16, os.urandom(32).hex(), device)
            keys = [os.urandom(32) for _ in range(num_blocks)]
            saves = [BlockTransfer("s", i, i, k) for i, k in enumerate(keys)]
            loads = [BlockTransfer("l", i, num_blocks + i, k) for i, k in enumerate(keys)]
            raw_dir = Path(tmp) / f"raw{r}"
            raw_dir.mkdir()
            paths = [raw_dir / f"{i}.bin" for i in range(num_blocks)]
            writer = FsPoolWorker(cfg, ctx)
            writer.register_kv_caches(KVCacheRegistration(kv, layout))
            reader = FsPoolWorker(cfg, ctx)  # a fresh one: an empty host tier
            reader.register_kv_caches(KVCacheRegistration(kv, layout))

            def raw_write():
                if cuda:
                    host.copy_(dev_bytes[:num_blocks])
                _raw(paths, views, threads, write=True)

            def raw_read():
                _raw(paths, views, threads, write=False)
                if cuda:
                    dev_bytes[num_blocks:].copy_(host)

            # alternate which goes first: page-cache writeback of the first slows the second
            steps = [("save", lambda: _transfer(writer, FsPoolMeta(saves=saves), "s", True)),
                     ("raw_write", lambda: _timed(raw_write, device)),
                     ("load", lambda: _transfer(reader, FsPoolMeta(loads=loads), "l", False)),
                     ("raw_read", lambda: _timed(raw_read, device))]
            order = steps if r % 2 == 0 else [steps[1], steps[0], steps[3], steps[2]]
            for name, fn in order:
                results[name].append(fn())
            assert torch.equal(kv[num_blocks:], original), "loaded bytes differ"
            if cuda:
                kv[num_blocks:].zero_()
                results["load_tier"].append(_transfer(reader, FsPoolMeta(loads=loads), "l", False))
                assert torch.equal(kv[num_blocks:], original), "bytes from the tier differ"
                results["h2d"].append(_timed(lambda: dev_bytes[num_blocks:].copy_(host), device))
            assert not reader.get_failed_loads(), "a load failed"
            reader.shutdown()
            writer.shutdown()
        stall = _save_stall(kv, layout, cfg, ctx, device) if cuda else None
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}
    result = {"bench": "pool-io", "device": device, "num_blocks": num_blocks,
              "block_bytes": layout.block_nbytes, "threads": threads, "rounds": rounds,
              **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
              "save_over_raw": gbps["save"] / gbps["raw_write"],
              "load_over_raw": gbps["load"] / gbps["raw_read"]}
    if stall:
        result.update(stall)
    print(f"{num_blocks} blocks of {layout.block_nbytes / 2**10:.0f} KiB "
          f"({nbytes / 2**20:.0f} MiB) on {device}, {threads} threads, median of {rounds} rounds")
    print(f"  save {gbps['save']:6.2f} GB/s vs raw write {gbps['raw_write']:6.2f} GB/s: "
          f"{result['save_over_raw']:.2f}")
    print(f"  load {gbps['load']:6.2f} GB/s vs raw read  {gbps['raw_read']:6.2f} GB/s: "
          f"{result['load_over_raw']:.2f}")
    if cuda:
        print(f"  load from the host tier {gbps['load_tier']:6.2f} GB/s; pinned H2D copy alone "
              f"{gbps['h2d']:6.2f} GB/s (the floor)")
        print(f"  a GPU step with a page of saves started after it: {stall['step_ms_saving']:.3f} ms"
              f" vs {stall['step_ms_alone']:.3f} ms without ({stall['step_saving_over_alone']:.3f}; "
              f"{stall['wait_for_save_ms']:.3f} ms of it in wait_for_save)")
    print(json.dumps(result))
    return 0


def _save_stall(kv: torch.Tensor, layout: KVCacheLayout, cfg: ConnectorConfig,
                ctx: ConnectorContext, device: str, steps: int = 20) -> dict:
    """Steps of GPU work (a chain of matmuls, ~ a small model's forward), each followed by
    wait_for_save of one page of blocks (as after a prefill), against the same steps with
    no saves. Each step ends with a host sync, as a step's sampled tokens do."""
    worker = FsPoolWorker(cfg, ctx)
    worker.register_kv_caches(KVCacheRegistration(kv, layout))
    per_page = min(worker.tier.blocks_per_page, kv.shape[0] // 2)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    host = []  # seconds inside wait_for_save, per step

    def run(saving: bool) -> float:
        pending = []
        start = time.perf_counter()
        for s in range(steps):
            x = a
            for _ in range(8):
                x = x @ a
            if saving:
                first = (s * per_page) % (kv.shape[0] - per_page)
                rid = f"r{saving}{s}"
                worker.bind_connector_meta(FsPoolMeta(saves=[
                    BlockTransfer(rid, i, first + i, os.urandom(32)) for i in range(per_page)]))
                begun = time.perf_counter()
                worker.wait_for_save()
                host.append(time.perf_counter() - begun)
                worker.clear_connector_meta()
                pending.append(rid)
            x[0, 0].item()
        elapsed = (time.perf_counter() - start) / steps
        while pending:
            done, _ = worker.get_finished(pending, [])
            pending = [r for r in pending if r not in done]
        return elapsed

    run(False), run(True)  # warm-up
    alone = statistics.median(run(False) for _ in range(3))
    saving = statistics.median(run(True) for _ in range(3))
    worker.shutdown()
    return {"step_ms_alone": 1e3 * alone, "step_ms_saving": 1e3 * saving,
            "wait_for_save_ms": 1e3 * statistics.median(host),
            "step_saving_over_alone": saving / alone}
