"""The built-in filesystem pool connector ("fs"; `LLM(kv_pool=DIR)`).

Content-addressed by block key, shared by any number of processes and ranks, persistent
across restarts (format and publish protocol: format.py). A store-backed connector
(store/scheduler.py, store/worker.py: which blocks move, partial loads, the host tier)
over `FsStore`, a directory of block files. Options: those of every store
(store/base.py: load_mode, io_threads, max_read_gbps, host_tier_bytes), and

    root            pool directory (required; created with owner-only permissions)
    max_bytes       optional capacity; the least recently used files are trimmed past it
    read_processes  processes that read block files into the host tier, each with a GIL
                    of its own (read_procs.py; 0: the I/O threads read). Default: on a
                    GPU with 8 CPUs or more, half the CPUs up to READ_PROCESSES_GPU (the
                    I/O threads then 4); 0 on a CPU and with max_read_gbps. Used where
                    blocks move through the tier (a GPU cache, or host_tier_bytes), and
                    not with max_read_gbps (its cap paces the threads' reads)

A lookup is an lstat per block (a request's run: a binary search for its first miss,
confirmed by a few probes); a read opens the file
relative to a directory fd kept open (format.BlockDirs) and reads header and payload with
one preadv. A corrupt file is moved to quarantine/, or, where it cannot be (a read-only
pool), never read again by this process.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from shoal.connectors.base import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.connectors.fs.admin import trim_pool
from shoal.connectors.fs.read_procs import ReadProcesses
from shoal.connectors.store.base import (BlockSpec, BlockStore, PoolOptions, UnitReader,
                                         default_io_threads, parse_pool_options, usable_cpus)
from shoal.connectors.store.block_format import BlockMissing, CorruptBlock
from shoal.connectors.store.load_queue import LoadQueue
from shoal.connectors.store.scheduler import BlockTransfer, PoolMeta, StoreScheduler
from shoal.connectors.store.worker import StoreWorker

__all__ = ["BlockTransfer", "FsPoolMeta", "FsPoolScheduler", "FsPoolWorker", "FsStore",
           "LoadQueue", "default_io_threads", "open_pool"]

log = logging.getLogger(__name__)

FsPoolMeta = PoolMeta  # the fs connector's plan is every store's
TOUCH_INTERVAL_SECONDS = 60.0
SCAN_BLOCKS = 16  # a lookup of up to this many blocks stopping at a miss checks each in turn
CONFIRM_PROBES = 8  # blocks inside a run's held prefix checked after the binary search
# read processes by default with the KV cache on a GPU (at most half the CPUs): an H100
# host's Llama-1B 8k hit from files loaded whole in 0.037 s with 8 (4 I/O threads) against
# 0.050 s read by 8 I/O threads (docs/benchmarks.md, twenty-third session)
READ_PROCESSES_GPU = 8
MIN_CPUS_FOR_PROCESSES = 8  # (fewer: the I/O threads read, as on a CPU)


@dataclass(frozen=True)
class FsPoolOptions:
    root: Path  # pool directory (created, owner-only)
    max_bytes: int | None
    read_processes: int
    shared: PoolOptions


def open_pool(config: ConnectorConfig, device: str = "cpu") -> FsPoolOptions:
    """Validate the fs options (ValueError naming the option) and create the pool dirs.
    `device`: where the KV cache lives (the defaults of io_threads and host_tier_bytes)."""
    opts = dict(config.options)
    capped = opts.get("max_read_gbps") is not None  # (the threads read, at the cap's pace)
    procs = opts.get("read_processes", default_read_processes(device, capped))
    if isinstance(procs, bool) or not isinstance(procs, int) or not 0 <= procs <= 64:
        raise ValueError(f"fs connector: read_processes must be an integer in [0, 64], "
                         f"got {procs!r}")
    shared = parse_pool_options("fs", opts, ("root", "max_bytes", "read_processes"), device,
                                read_processes=procs > 0 and not capped)
    if not opts.get("root"):
        raise ValueError("fs connector: options['root'] (the pool directory) is required")
    cap = opts.get("max_bytes")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
        raise ValueError(f"fs connector: max_bytes must be a positive integer, got {cap!r}")
    root = Path(opts["root"]).expanduser()
    try:
        pf.ensure_pool_dirs(root)
    except OSError as e:
        raise ValueError(f"fs connector: root (kv_pool) {str(root)!r} cannot be used as a pool "
                         f"directory: {_why_unusable(root, e)}") from None
    return FsPoolOptions(root, cap, procs, shared)


def default_read_processes(device: str, capped: bool = False) -> int:
    """On a GPU: half the usable CPUs, up to READ_PROCESSES_GPU. None on a CPU (blocks are
    read straight into the cache), under a read cap (`capped`: max_read_gbps), or with
    fewer than MIN_CPUS_FOR_PROCESSES CPUs (there they would be fewer than the I/O
    threads; the processes were only measured on a 16-CPU host)."""
    cpus = usable_cpus()
    if not device.startswith("cuda") or capped or cpus < MIN_CPUS_FOR_PROCESSES:
        return 0
    return min(READ_PROCESSES_GPU, cpus // 2)


def _why_unusable(root: Path, e: OSError) -> str:
    if os.path.lexists(root) and not os.path.isdir(root):
        return "it exists and is not a directory"
    if isinstance(e, NotADirectoryError) and e.filename is not None:
        return "a part of its path is a file, not a directory"
    return e.strerror or str(e)


class _UnusableFiles:
    """Corrupt block files this process could not quarantine (a read-only pool): never read
    again, and a miss at lookup, for the rest of the process's life. One per process on
    purpose: the scheduler and worker sides share no object, and a file that failed once
    fails for every engine of the process (under TP and ADP, ranks in other processes learn
    of a file when they read it themselves)."""

    def __init__(self):
        self._paths: set[str] = set()  # block paths, as block_path_str spells them
        self._lock = threading.Lock()

    def add(self, path: str) -> None:
        with self._lock:
            self._paths.add(path)

    def __contains__(self, path: str) -> bool:
        return path in self._paths  # no lock: a set lookup is atomic, and adds are rare


UNUSABLE_FILES = _UnusableFiles()


class FsStore(BlockStore):
    """Block files under `root` (format.py). `max_bytes`: trim the least recently used
    files once a tenth of it has been written since the last trim, and at close."""

    def __init__(self, root: Path, max_bytes: int | None = None, read_processes: int = 0):
        self.root, self.max_bytes = root, max_bytes
        self.read_processes = read_processes
        self._readers: ReadProcesses | None = None
        self._root_str = str(root)
        self._dirs = pf.BlockDirs(root)  # blocks/<xx> opened once, not per block
        # refresh a loaded file's mtime (LRU) at most once a minute: a metadata write per
        # load would cost more than the load
        self._touch_after = None if max_bytes is None else TOUCH_INTERVAL_SECONDS
        self._lock = threading.Lock()
        self._bytes_since_trim = 0

    def contains(self, keys: Sequence[bytes], stop_at_miss: bool = False,
                 group: int = 1) -> list[bool]:
        """A lookup per key; with stop_at_miss and more than SCAN_BLOCKS blocks (groups), a
        search for the first block not held whole: the blocks of a request's run are
        published front to back (a block's key names every token before it), so what the
        pool holds of a run is mostly a prefix of it. A binary search finds where that
        prefix ends, then CONFIRM_PROBES blocks spread over it are checked; a miss there (a
        hole: files trimmed by age or quarantined) falls back to checking every block. ~20
        lookups for 512 blocks instead of 512. Still a hint, as the contract allows: a
        hole the probes miss is found by the load, which fails from there, and the engine
        recomputes (and saves) it."""
        if stop_at_miss and len(keys) > SCAN_BLOCKS * group:
            held = self._leading_run(keys, group)
            if held is not None:
                return [True] * (held * group) + [False] * (held * group < len(keys))
        found = []
        for key in keys:
            found.append(self._has(key))
            if stop_at_miss and not found[-1]:
                break
        return found

    def _has(self, key: bytes) -> bool:
        path = pf.block_path_str(self._root_str, key)
        return path not in UNUSABLE_FILES and pf.is_block_file(path)

    def _leading_run(self, keys: Sequence[bytes], group: int) -> int | None:
        """Blocks held whole at the front of the run, if the probes find it a prefix (None:
        they found a hole)."""
        num = len(keys) // group

        def held(b: int) -> bool:
            return all(self._has(k) for k in keys[b * group:(b + 1) * group])
        if not held(0):
            return 0
        if held(num - 1):
            end = num
        else:
            lo, hi = 0, num - 1  # block lo is held, block hi is not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if held(mid) else (lo, mid)
            end = hi
        probes = {end * i // (CONFIRM_PROBES + 1) for i in range(1, CONFIRM_PROBES + 1)}
        return end if all(held(b) for b in sorted(probes)) else None

    def read_unit(self, keys: Sequence[bytes], spec: BlockSpec) -> UnitReader:
        return _FileReader(self, keys, spec)

    def start_read_processes(self, spec: BlockSpec, tier, readers: int) -> None:
        self._readers = ReadProcesses(self.root, spec, tier.fd, tier.slab.numel(),
                                      self.read_processes, self._touch_after, readers)

    def read_rows(self, keys: list[bytes], first_row: int, verify: bool) -> list | None:
        if self._readers is None:
            return None
        answers = self._readers.read(keys, first_row, verify)
        if answers is not None:  # (files this process set aside are never used again)
            for j, key in enumerate(keys):
                if pf.block_path_str(self._root_str, key) in UNUSABLE_FILES:
                    answers[j] = BlockMissing(f"{key.hex()}: corrupt and not quarantined")
        return answers

    def write(self, key: bytes, payload: memoryview, spec: BlockSpec) -> bool:
        written = pf.write_block(self.root, spec.namespace, key, payload, spec.shape,
                                 spec.dtype, self._dirs)
        if written and self.max_bytes is not None:
            with self._lock:
                self._bytes_since_trim += payload.nbytes
                trim = self._bytes_since_trim > self.max_bytes // 10
                if trim:
                    self._bytes_since_trim = 0
            if trim:
                self._trim()
        return written

    def set_aside(self, key: bytes, error: CorruptBlock) -> None:
        """Quarantine a corrupt file; one that cannot be moved (a read-only pool, quarantine/
        replaced by a link) is remembered instead. Either way the block is recomputed."""
        try:
            pf.quarantine(self.root, key, error.reason)
        except OSError as e:
            UNUSABLE_FILES.add(pf.block_path_str(self._root_str, key))
            log.warning("pool block %s is corrupt (%s) and cannot be quarantined (%s): "
                        "skipped for the rest of this process, recomputing", key.hex(), error, e)
            return
        log.warning("pool block %s is corrupt (%s): quarantined, recomputing", key.hex(), error)

    def close(self) -> None:
        if self._readers is not None:
            self._readers.close()
        self._dirs.close()
        if self.max_bytes is not None:
            # while running, the pool may pass max_bytes by what is written between trims
            # (a tenth of it) plus saves in flight; at the end it holds at most max_bytes
            self._trim()

    def _trim(self) -> None:
        """Trim to max_bytes; a failure (a read-only pool, a directory replaced by a link) is
        logged, never fatal: a pool past its cap still serves verified blocks."""
        try:
            trim_pool(self.root, self.max_bytes)
        except OSError as e:
            log.warning("pool trim to %d bytes failed: %s", self.max_bytes, e)


class _FileReader(UnitReader):
    def __init__(self, store: FsStore, keys: Sequence[bytes], spec: BlockSpec):
        self.store, self.keys, self.spec = store, keys, spec

    def read_into(self, i: int, dest: memoryview, verify: bool = True) -> int:
        store, key = self.store, self.keys[i]
        if pf.block_path_str(store._root_str, key) in UNUSABLE_FILES:
            raise BlockMissing(f"{key.hex()}: corrupt and not quarantined")
        return pf.read_block_into(store.root, self.spec.namespace, key, dest, self.spec.shape,
                                  self.spec.dtype, touch_after=store._touch_after,
                                  dirs=store._dirs, verify=verify)


class FsPoolScheduler(StoreScheduler):
    @classmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        opts = open_pool(config, device)
        return FsStore(opts.root), opts.shared  # lookups only: never trims


class FsPoolWorker(StoreWorker):
    @classmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        opts = open_pool(config, device)
        return FsStore(opts.root, opts.max_bytes, opts.read_processes), opts.shared
