"""`shoal bench pool-io --pool redis://...`: the redis connector's save and load GB/s
against the same client doing raw SET / GET of the same values (header and payload) with the
same number of threads (each its own connection), in one run.

Blocks of SmolLM2's shape in float32 in CPU memory (`--device cuda`: Llama-3.2-1B's in
bf16 on the GPU, through the host tier). The raw baseline sends each thread's share of
the blocks and drops the values it gets back as they come (no copy into
the KV cache, no check), both one command per value and in pipelines of about 1 MiB;
the faster of the two (by its median) is the baseline (the most the client does with these bytes). Each
round writes under a fresh key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from shoal.bench.pool_io import _sync, _transfer
from shoal.connectors import ConnectorConfig, ConnectorContext, KVCacheRegistration
from shoal.connectors.redis.connector import RedisPoolWorker, open_redis_pool
from shoal.connectors.redis.store import PIPELINE_BYTES
from shoal.connectors.store.block_format import checksum, encode_header
from shoal.connectors.store.scheduler import BlockTransfer, PoolMeta
from shoal.kv.kv_cache import KVCacheLayout


def _raw(store, names: list[str], values: list[bytes] | None, threads: int,
         batch: int) -> float:
    """Each thread sends its share of SETs (values given) or GETs, `batch` per pipeline
    (1: one command at a time)."""
    shares = [list(range(t, len(names), threads)) for t in range(threads)]

    def one(share: list[int]) -> None:
        missed = 0
        for j in range(0, len(share), batch):  # values are dropped as they come
            pipe = store.client.pipeline(transaction=False) if batch > 1 else store.client
            got = [pipe.get(names[i]) if values is None else pipe.set(names[i], values[i])
                   for i in share[j:j + batch]]
            missed += sum(v is None for v in (pipe.execute() if batch > 1 else got))
        assert not missed, "a raw GET missed"
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, shares))
    return time.perf_counter() - start


def run_pool_io_redis(url: str, num_blocks: int, threads: int, rounds: int,
                      device: str = "cpu") -> int:
    cuda = device.startswith("cuda")
    if cuda:  # Llama-3.2-1B: 16 layers x (k, v) x 16 tokens x 8 KV heads x 64 dims, bf16
        layout = KVCacheLayout(num_blocks, 16, 16, 8, 64, torch.bfloat16)
    else:  # SmolLM2: 30 layers x (k, v) x 16 tokens x 3 KV heads x 64 dims, float32
        layout = KVCacheLayout(num_blocks, 30, 16, 3, 64, torch.float32)
    kv = torch.randn((2 * num_blocks, *layout.block_shape), device=device).to(layout.dtype)
    original = kv[:num_blocks].clone()
    host = kv[:num_blocks].reshape(num_blocks, -1).view(torch.uint8).cpu()
    nbytes = num_blocks * layout.block_nbytes
    results: dict[str, list[float]] = {k: [] for k in (
        "save", "raw_write_one", "raw_write_pipe", "load", "raw_read_one", "raw_read_pipe")}
    for r in range(rounds):
        prefix = f"shoalbench{os.getpid()}r{r}:"
        cfg = ConnectorConfig(name="redis", options={"url": url, "io_threads": threads,
                                                     "key_prefix": prefix})
        namespace = os.urandom(32)
        ctx = ConnectorContext(0, 1, 0, 1, 0, 1, 16, namespace.hex(), device)
        keys = [os.urandom(32) for _ in range(num_blocks)]
        store, _ = open_redis_pool(cfg, device)
        # each raw variant writes names of its own: new keys, as the connector's saves are
        raw_names = {b: [f"{prefix}raw{b}:{k.hex()}" for k in keys] for b in ("one", "pipe")}
        raw_values = [encode_header(namespace, k, tuple(layout.block_shape), layout.dtype,
                                    layout.block_nbytes, checksum(host[i].numpy()))
                      + host[i].numpy().tobytes() for i, k in enumerate(keys)]
        writer = RedisPoolWorker(cfg, ctx)
        writer.register_kv_caches(KVCacheRegistration(kv, layout))
        reader = RedisPoolWorker(cfg, ctx)  # a fresh one: an empty host tier
        reader.register_kv_caches(KVCacheRegistration(kv, layout))
        saves = [BlockTransfer("s", i, i, k) for i, k in enumerate(keys)]
        loads = [BlockTransfer("l", i, num_blocks + i, k) for i, k in enumerate(keys)]
        batch = {"one": 1, "pipe": max(2, PIPELINE_BYTES // len(raw_values[0]))}

        def raw(values):  # one command per value, and ~1 MiB pipelines
            return {mode: _raw(store, raw_names[mode], values, threads, batch[mode])
                    for mode in ("one", "pipe")}
        steps = [("save", lambda: _transfer(writer, PoolMeta(saves=saves), "s", True)),
                 ("raw_write", lambda: raw(raw_values)),
                 ("load", lambda: _transfer(reader, PoolMeta(loads=loads), "l", False)),
                 ("raw_read", lambda: raw(None))]
        order = steps if r % 2 == 0 else [steps[1], steps[0], steps[3], steps[2]]
        for name, fn in order:
            _sync(device)
            got = fn()
            if isinstance(got, dict):
                for mode, seconds in got.items():
                    results[f"{name}_{mode}"].append(seconds)
            else:
                results[name].append(got)
        _sync(device)
        assert torch.equal(kv[num_blocks:], original), "loaded bytes differ"
        assert not reader.get_failed_loads(), "a load failed"
        stats = writer.stats()
        assert stats["save_failures"] == 0, f"saves failed: {stats}"
        reader.shutdown()
        writer.shutdown()
        names = list(store.client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(names), 256):
            store.client.delete(*names[i:i + 256])
        store.close()
        kv[num_blocks:].zero_()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in results.items()}
    for kind in ("raw_write", "raw_read"):  # the baseline: the client's faster way
        gbps[kind] = max(gbps[f"{kind}_one"], gbps[f"{kind}_pipe"])
    result = {"bench": "pool-io", "pool": "redis", "device": device, "num_blocks": num_blocks,
              "block_bytes": layout.block_nbytes, "threads": threads, "rounds": rounds,
              **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
              "save_over_raw": gbps["save"] / gbps["raw_write"],
              "load_over_raw": gbps["load"] / gbps["raw_read"]}
    print(f"{num_blocks} blocks of {layout.block_nbytes / 2**10:.0f} KiB "
          f"({nbytes / 2**20:.0f} MiB) on {device}, {threads} threads and connections, "
          f"median of {rounds} rounds, store {store.target.display}")
    print(f"  save {gbps['save']:6.2f} GB/s vs raw SET {gbps['raw_write']:6.2f} GB/s: "
          f"{result['save_over_raw']:.2f}")
    print(f"  load {gbps['load']:6.2f} GB/s vs raw GET {gbps['raw_read']:6.2f} GB/s: "
          f"{result['load_over_raw']:.2f}")
    print(json.dumps(result))
    return 0
