"""What a pool connector needs of the place it keeps blocks: the `BlockStore` contract.

A store keeps blocks (store/block_format.py: a header, then the payload) under their
keys, each published whole or not at all and never overwritten, and verified when read.
The fs pool keeps them as files (connectors/fs), the redis pool as values in Redis,
Valkey or a Redis Cluster (connectors/redis). Everything else a pool connector does
(which blocks to load and save, partial loads, the host tier, deadlines, aborts) is the
same for every store: store/scheduler.py and store/worker.py.

Options every store-backed connector takes (`parse_pool_options`):

    load_mode       "async" (default: loads run on the I/O threads while other requests
                    compute) or "sync" (loads run inside start_load_kv)
    io_threads      I/O worker threads (default 4, 8 with the KV cache on a GPU unless
                    processes read the store; never more than the CPUs this process may use)
    max_read_gbps   optional cap on the rate blocks are read from the store, in GB/s over
                    all I/O threads (a slow or shared store; benchmarks model one)
    host_tier_bytes host memory kept as a cache of recently loaded and saved blocks, per
                    process (default 2 GiB with the KV cache on a GPU, where it is pinned
                    and also stages every copy: at least 4 pages of 16 MiB per I/O thread
                    are kept; 0 on a CPU, where blocks are read straight into the cache)
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from shoal.connectors.store.block_format import CorruptBlock

POOL_OPTIONS = ("load_mode", "io_threads", "max_read_gbps", "host_tier_bytes")
DEFAULT_TIER_BYTES_GPU = 2 << 30


class StoreError(OSError):
    """The store could not be reached or refused an operation (a connection lost or timed
    out, a store that is down or full). A read that raises it is a miss; a write, a failed
    save: both are counted, neither is fatal."""


@dataclass(frozen=True)
class BlockSpec:
    """What every block of one rank's KV cache looks like (a read checks the header)."""

    namespace: bytes  # this rank's shard namespace
    shape: tuple[int, ...]  # one block: [num_layers, 2, block_size, num_kv_heads, head_dim]
    dtype: torch.dtype
    nbytes: int  # payload bytes of one block


class UnitReader(abc.ABC):
    """Reads the blocks of one load unit (keys given at `BlockStore.read_unit`). A store may
    fetch them all at the first read (one round trip); each block is read at most once."""

    @abc.abstractmethod
    def read_into(self, i: int, dest: memoryview, verify: bool = True) -> int:
        """Block i's payload into `dest`, every header field checked, the payload hashed
        unless `verify` is False (the caller verifies against the returned value: a GPU
        does). Returns the header's checksum. Raises BlockMissing, CorruptBlock (dest
        then holds garbage) or StoreError (a miss too)."""


class BlockStore(abc.ABC):
    """The place a pool connector keeps blocks. Thread-safe: the I/O threads share one."""

    @abc.abstractmethod
    def contains(self, keys: Sequence[bytes], stop_at_miss: bool = False,
                 group: int = 1) -> list[bool]:
        """Whether a block is published under each key (a hint: reads verify). With
        stop_at_miss the answer may end after its first False; `group`: the keys come in
        groups of this many (a block's TP shards), and a group counts as held only if all
        of it is. A store that cannot be reached answers False (misses), never raises."""

    @abc.abstractmethod
    def read_unit(self, keys: Sequence[bytes], spec: BlockSpec) -> UnitReader:
        """A reader of these blocks (one load unit)."""

    @abc.abstractmethod
    def write(self, key: bytes, payload: memoryview, spec: BlockSpec) -> bool:
        """Publish one block whole; False if the key is published already (never
        overwritten). Raises OSError (StoreError for a store) if it cannot."""

    @abc.abstractmethod
    def set_aside(self, key: bytes, error: CorruptBlock) -> None:
        """The block under `key` failed verification: make sure no reader finds it again
        (moved aside, deleted, or at least never read again by this process)."""

    # processes this store would read blocks with (read_rows), once given a shared tier
    read_processes = 0

    def start_read_processes(self, spec: BlockSpec, tier, readers: int) -> None:
        """Start `read_processes` processes reading into the shared slab of `tier` (a
        HostTier made with shared=True), for `readers` I/O threads reading through them."""
        raise NotImplementedError(f"{type(self).__name__} reads on the I/O threads")

    def read_rows(self, keys: list[bytes], first_row: int, verify: bool) -> list | None:
        """Read `keys[j]` into slab row `first_row + j` in a read process: per block the
        header's checksum, or the exception `UnitReader.read_into` would raise; None if no
        read process runs (the caller reads)."""
        return None

    def warm_up(self, num_threads: int) -> None:
        """Bring-up: get ready for this many I/O threads at once (e.g. open connections),
        so that the first load does not pay for it. Never raises."""

    def stats(self) -> dict[str, float]:
        """Counters of the store's own (e.g. connection errors); summed into LLM.stats()."""
        return {}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class PoolOptions:
    """The options of every store-backed connector (module docstring), validated."""

    is_async: bool  # load_mode == "async"
    io_threads: int
    max_read_gbps: float | None  # cap on the rate blocks are read (None: none)
    host_tier_bytes: int


def default_io_threads(on_gpu: bool, read_processes: bool = False) -> int:
    """4 (8 for a KV cache on a GPU, unless processes read the files: the threads then
    only launch copies, and fewer of them queue for the GIL), but no more than the CPUs
    this process may run on: every read costs CPU time (on a CPU its hash too), and more
    threads than cores only contend for them and for the GIL (2-core machine, pool-io:
    loads 7.45 GB/s with 2 threads, 5.1-5.4 with 4). Set io_threads to override."""
    return max(1, min(8 if on_gpu and not read_processes else 4, usable_cpus()))


def usable_cpus() -> int:
    """The CPUs the calling thread may run on (its affinity: a container's CPU quota is
    not seen)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def parse_pool_options(name: str, opts: dict[str, Any], own: Sequence[str],
                       device: str, read_processes: bool = False) -> PoolOptions:
    """Validate the shared options (ValueError naming the connector and the option);
    `own`: the options the connector itself takes (any other name is refused);
    `read_processes`: processes read the store (the default io_threads)."""
    unknown = set(opts) - set(POOL_OPTIONS) - set(own)
    if unknown:
        raise ValueError(f"{name} connector: unknown options {sorted(unknown)}")
    mode = opts.get("load_mode", "async")
    if mode not in ("async", "sync"):
        raise ValueError(f"{name} connector: load_mode must be 'async' or 'sync', got {mode!r}")
    on_gpu = device.startswith("cuda")
    threads = opts.get("io_threads", default_io_threads(on_gpu, read_processes))
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ValueError(f"{name} connector: io_threads must be an integer in [1, 64], "
                         f"got {threads!r}")
    tier = opts.get("host_tier_bytes", DEFAULT_TIER_BYTES_GPU if on_gpu else 0)
    if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
        raise ValueError(f"{name} connector: host_tier_bytes must be an integer >= 0, "
                         f"got {tier!r}")
    read_cap = opts.get("max_read_gbps")
    if read_cap is not None and (isinstance(read_cap, bool)
                                 or not isinstance(read_cap, (int, float))
                                 or not 0 < read_cap < float("inf")):
        raise ValueError(f"{name} connector: max_read_gbps must be a number > 0, "
                         f"got {read_cap!r}")
    return PoolOptions(mode == "async", threads, None if read_cap is None else float(read_cap),
                       tier)
