"""The built-in filesystem pool connector ("fs"; `LLM(kv_pool=DIR)`).

Content-addressed by block key, shared by any number of processes and ranks, persistent
across restarts (format and publish protocol: format.py). Options:

    root            pool directory (required; created with owner-only permissions)
    load_mode       "async" (default: loads run on the I/O threads while other requests
                    compute) or "sync" (loads run inside start_load_kv)
    io_threads      I/O worker threads (default 4, 8 with the KV cache on a GPU; never more
                    than the CPUs this process may use)
    max_bytes       optional capacity; the least recently used files are trimmed past it
    max_read_gbps   optional cap on the rate blocks are read from files, in GB/s over all
                    I/O threads (a pool on a slow or shared disk; benchmarks model one)
    host_tier_bytes host memory kept as a cache of recently loaded and saved blocks, per
                    process (default 2 GiB with the KV cache on a GPU, where it is pinned
                    and also stages every copy: at least 4 pages of 16 MiB per I/O thread
                    are kept; 0 on a CPU, where blocks are read straight into the cache)

With a GPU cache (or a host tier) blocks move through pinned host pages, a page at a
time, with copies on side streams (paged_io.py); on a GPU the blocks read from files are
verified there, after the copy (gpu_xxh3.py), where Triton is present. On a CPU without a
tier they are read straight into, and written straight from, the KV cache's memory.

Only full prompt blocks move (the engine's `block_keys`). A block is saved by the step
that completes it, unless the pool has it already; a request's load covers the longest
run of consecutive pool hits after its local prefix hit. Loads are partial (SPEC 3.1):
a request's blocks are read last first, a unit (a page, or a few blocks) at a time, by
as many I/O threads as there are units; the engine's drops take the units no thread has
started off the queue, and `get_load_progress` says which blocks may still be written
and which have landed. Under TP each rank's worker
stores its shard under `shard_key(key, rank, world_size)`; the scheduler side (rank 0)
counts a block as a hit only if every shard's file exists, and saves it if any is missing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shoal.kv.block_keys import shard_key, shard_namespace
from shoal.connectors.fs import format as pf
from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   KvConnectorScheduler, KvConnectorWorker, LoadProgress,
                                   RequestView, SchedulerOutput)
from shoal.connectors.fs.admin import trim_pool
from shoal.connectors.fs.host_tier import HostTier, tier_shape
from shoal.connectors.fs.paged_io import PagedMover

log = logging.getLogger(__name__)

TOUCH_INTERVAL_SECONDS = 60.0
# A load unit: what one I/O thread reads before it takes the next. On a CPU without a
# tier, a few blocks, so that the units all threads hold at once are a small part of a
# load and a drop takes most of what the engine's front reaches. Through the tier, a page:
# units of 1-4 blocks loaded an 8k-token Llama-1B hit at a third of the rate of pages on
# an H200 (a copy, a check and a wait per unit); there the admission's split does the work.
CPU_BLOCKS_PER_UNIT = 4


@dataclass(frozen=True)
class BlockTransfer:
    request_id: str
    block_index: int  # position of the block in the request (block i = tokens i*bs ...)
    block_id: int  # where it lives in the local KV cache
    key: bytes


@dataclass
class FsPoolMeta:
    """One step's plan."""

    loads: list[BlockTransfer] = field(default_factory=list)  # pool -> KV, last block first
    saves: list[BlockTransfer] = field(default_factory=list)  # KV -> pool
    drops: dict[str, int] = field(default_factory=dict)  # rid -> its loads below this block
    # index are dropped (the engine computes them)


@dataclass(frozen=True)
class FsPoolOptions:
    root: Path  # pool directory (created, owner-only)
    is_async: bool  # load_mode == "async"
    io_threads: int
    max_bytes: int | None
    host_tier_bytes: int
    max_read_gbps: float | None  # cap on the rate blocks are read from files (None: none)


DEFAULT_TIER_BYTES_GPU = 2 << 30


def default_io_threads(on_gpu: bool) -> int:
    """4 (8 for a KV cache on a GPU), but no more than the CPUs this process may run on:
    every read costs CPU time (on a CPU its hash too), and more threads than cores only
    contend for them and for the GIL (2-core machine, pool-io: loads 7.45 GB/s with 2
    threads, 5.1-5.4 with 4).
    The CPUs are the calling thread's affinity (a CPU quota of a container is not seen);
    set io_threads to override."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8 if on_gpu else 4, cores))


def open_pool(config: ConnectorConfig, device: str = "cpu") -> FsPoolOptions:
    """Validate the fs options (ValueError naming the option) and create the pool dirs.
    `device`: where the KV cache lives (the defaults of io_threads and host_tier_bytes)."""
    opts = dict(config.options)
    unknown = set(opts) - {"root", "load_mode", "io_threads", "max_bytes", "host_tier_bytes",
                           "max_read_gbps"}
    if unknown:
        raise ValueError(f"fs connector: unknown options {sorted(unknown)}")
    if not opts.get("root"):
        raise ValueError("fs connector: options['root'] (the pool directory) is required")
    mode = opts.get("load_mode", "async")
    if mode not in ("async", "sync"):
        raise ValueError(f"fs connector: load_mode must be 'async' or 'sync', got {mode!r}")
    on_gpu = device.startswith("cuda")
    threads = opts.get("io_threads", default_io_threads(on_gpu))
    if not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ValueError(f"fs connector: io_threads must be an integer in [1, 64], got {threads!r}")
    cap = opts.get("max_bytes")
    if cap is not None and (not isinstance(cap, int) or cap <= 0):
        raise ValueError(f"fs connector: max_bytes must be a positive integer, got {cap!r}")
    tier = opts.get("host_tier_bytes", DEFAULT_TIER_BYTES_GPU if on_gpu else 0)
    if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
        raise ValueError(f"fs connector: host_tier_bytes must be an integer >= 0, got {tier!r}")
    read_cap = opts.get("max_read_gbps")
    if read_cap is not None and (isinstance(read_cap, bool) or not isinstance(read_cap, (int, float))
                                 or not 0 < read_cap < float("inf")):
        raise ValueError(f"fs connector: max_read_gbps must be a number > 0, got {read_cap!r}")
    root = Path(opts["root"]).expanduser()
    try:
        pf.ensure_pool_dirs(root)
    except OSError as e:
        raise ValueError(f"fs connector: root (kv_pool) {str(root)!r} cannot be used as a pool "
                         f"directory: {_why_unusable(root, e)}") from None
    return FsPoolOptions(root, mode == "async", threads, cap, tier,
                         None if read_cap is None else float(read_cap))


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


@dataclass
class _RequestState:
    block_ids: list[int]
    num_checked: int = 0  # leading full blocks already considered for saving
    loading: range = range(0)  # blocks of its load (planned at admission)
    dropped_to: int = 0  # blocks of it below this index the engine computes (in the pool)
    has_saves: bool = False
    saved_keys: list[bytes] = field(default_factory=list)  # saves scheduled for it


class FsPoolScheduler(KvConnectorScheduler):
    supports_attention_dp = True
    supports_partial_loads = True

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        super().__init__(config, ctx)
        opts = open_pool(config)
        self.root, self.is_async = opts.root, opts.is_async
        self._root_str = str(self.root)
        self._num_shards = ctx.num_shards
        self._matched: dict[str, tuple[int, int]] = {}  # rid -> (first block, num blocks)
        self._loading: dict[str, range] = {}  # rid -> blocks of the load planned at admission
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._drops: dict[str, int] = {}  # rid -> drop bound for loads already planned
        self._dropped_to: dict[str, int] = {}  # drops of requests not yet in a plan
        self._saving_keys: set[bytes] = set()  # saves scheduled by live requests
        self._stats = dict(pool_lookups=0, pool_hit_blocks=0, pool_miss_blocks=0)

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.ctx.block_size
        first = num_computed_tokens // bs
        last = (len(request.prompt_token_ids) - 1) // bs  # never the last prompt token's block
        hits = 0
        for i in range(first, min(last, len(request.block_keys))):
            if not self._in_pool(request.block_keys[i]):
                break
            hits += 1
        self._stats["pool_lookups"] += 1
        self._stats["pool_hit_blocks"] += hits
        self._stats["pool_miss_blocks"] += max(last - first - hits, 0)
        if hits == 0:
            self._matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (first, hits)
        return hits * bs, self.is_async

    def update_state_after_alloc(self, request: RequestView, block_ids: list[int]) -> None:
        first, num = self._matched.pop(request.request_id, (0, 0))
        if num:
            self._loading[request.request_id] = range(first, first + num)
        for i in reversed(range(first, first + num)):  # last block first
            self._pending_loads.append(BlockTransfer(request.request_id, i, block_ids[i],
                                                     request.block_keys[i]))

    def drop_loads(self, request: RequestView, num_blocks: int) -> None:
        rid = request.request_id
        st = self._requests.get(rid)
        if st is not None:
            st.dropped_to = max(st.dropped_to, num_blocks)
        else:  # admitted this step: its state is made by the next plan
            self._dropped_to[rid] = max(self._dropped_to.get(rid, 0), num_blocks)
        planned = len(self._pending_loads)
        self._pending_loads = [t for t in self._pending_loads
                               if t.request_id != rid or t.block_index >= num_blocks]
        if len(self._pending_loads) == planned:  # its loads went out in an earlier plan
            self._drops[rid] = max(self._drops.get(rid, 0), num_blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FsPoolMeta:
        meta = FsPoolMeta(loads=self._pending_loads, drops=self._drops)
        self._pending_loads, self._drops = [], {}
        bs = self.ctx.block_size
        for rd in scheduler_output.new_requests:
            prev = self._requests.get(rd.request_id)
            self._requests[rd.request_id] = _RequestState(
                list(rd.new_block_ids), has_saves=prev is not None and prev.has_saves,
                saved_keys=[] if prev is None else prev.saved_keys,
                loading=self._loading.pop(rd.request_id, range(0)),
                dropped_to=self._dropped_to.pop(rd.request_id, 0))
        for rd in scheduler_output.cached_requests:
            self._requests[rd.request_id].block_ids.extend(rd.new_block_ids)
        for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            st = self._requests[rd.request_id]
            computed = rd.computed_position // bs
            full = min((rd.computed_position + rd.num_scheduled_tokens) // bs,
                       len(rd.block_keys), len(st.block_ids))
            for i in range(st.num_checked, full):
                key = rd.block_keys[i]
                # a block of the hit that was loaded before this step's chunk, or that the
                # engine computes instead of loading it, is in the pool: no need to look
                # for its file again (a block the load failed is first checked in the step
                # that recomputes it: looked up, saved)
                in_pool = i in st.loading and (i < computed or i < st.dropped_to)
                if in_pool or key in self._saving_keys or self._in_pool(key):
                    continue
                self._saving_keys.add(key)
                st.saved_keys.append(key)
                meta.saves.append(BlockTransfer(rd.request_id, i, st.block_ids[i], key))
                st.has_saves = True
            st.num_checked = max(st.num_checked, full)
        return meta

    def _in_pool(self, key: bytes) -> bool:
        """Every shard of the block has a regular file in the pool, none of them one this
        process could not quarantine (validity is checked when it is read)."""
        n = self._num_shards
        for r in range(n):
            path = pf.block_path_str(self._root_str, shard_key(key, r, n))
            if path in UNUSABLE_FILES or not pf.is_block_file(path):
                return False
        return True

    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool:
        self._matched.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._dropped_to.pop(request.request_id, None)
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return False
        # the files exist or are being written: later requests find them on disk (a rare
        # duplicate write of an in-flight key is harmless: publishing never overwrites)
        self._saving_keys.difference_update(st.saved_keys)
        return st.has_saves

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


class FsPoolWorker(KvConnectorWorker):
    supports_attention_dp = True
    supports_abort = True  # I/O not started is cancelled; I/O in progress is waited for
    supports_partial_loads = True

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        super().__init__(config, ctx)
        opts = open_pool(config, ctx.device)
        self.root, self.is_async, self.max_bytes = opts.root, opts.is_async, opts.max_bytes
        self._tier_bytes = opts.host_tier_bytes
        self._root_str = str(self.root)
        self._dirs = pf.BlockDirs(self.root)  # blocks/<xx> opened once, not per block
        # refresh a loaded file's mtime (LRU) at most once a minute: a metadata write per
        # load would cost more than the load
        self._touch_after = None if self.max_bytes is None else TOUCH_INTERVAL_SECONDS
        # the shard this rank holds (TP), named in its files' keys and headers
        self._shard = (ctx.shard_rank, ctx.num_shards)
        self.namespace = shard_namespace(bytes.fromhex(ctx.namespace), *self._shard)
        self._num_threads = opts.io_threads
        self._io = ThreadPoolExecutor(self._num_threads, thread_name_prefix="shoal-fs-io")
        self._lock = threading.Lock()
        self._loads: dict[str, list[Future]] = {}
        self._queues: dict[str, _LoadQueue] = {}  # rid -> its pending load's units
        self._final: dict[str, LoadProgress] = {}  # loads reported finished by the last poll
        self._throttle = None if opts.max_read_gbps is None else _Throttle(opts.max_read_gbps)
        self._saves: dict[str, list[Future]] = {}
        self._bad_block: dict[str, int] = {}  # rid -> first failed block index (loads pending)
        self._failed: dict[str, int] = {}  # failures of loads reported finished
        self._bytes_since_trim = 0
        self._stats = dict(bytes_loaded=0, bytes_saved=0, load_seconds=0.0, save_seconds=0.0,
                           corrupt_blocks=0, missing_blocks=0, save_failures=0,
                           blocks_loaded=0, blocks_saved=0)
        self.tier: HostTier | None = None
        self._mover: PagedMover | None = None

    def register_kv_caches(self, kv_caches: KVCacheRegistration) -> None:
        self.kv = kv_caches.tensor
        self.layout = kv_caches.layout
        self.block_shape = tuple(kv_caches.layout.block_shape)
        self.dtype = kv_caches.layout.dtype
        self.on_cpu = self.kv.device.type == "cpu"
        nbytes = kv_caches.layout.block_nbytes
        # on a GPU every copy is staged in pages: enough for all threads at once
        num_pages, per_page = tier_shape(self._tier_bytes, nbytes,
                                         0 if self.on_cpu else 4 * (self._num_threads + 1))
        if num_pages:
            self.tier = HostTier(nbytes, num_pages, per_page, pinned=not self.on_cpu)
            self._mover = PagedMover(self.kv, self.tier)
            # saves are finished on threads of their own (paged_io: why that cannot hang);
            # few of them: each file costs some Python under the GIL, and many writer
            # threads queueing for it delay the executing thread's launches (measured)
            self._writers = ThreadPoolExecutor(max(1, self._num_threads // 4),
                                               thread_name_prefix="shoal-fs-write")
            self._block_bytes = []
            if self._mover.is_cuda:
                self._start_io_threads()
                self._mover.warm_up()
        else:  # byte views of every block, made once: loads read straight into block memory
            self._block_bytes = [_bytes_of(self.kv[i]) for i in range(len(self.kv))]

    def _start_io_threads(self) -> None:
        """Start every I/O thread now, each with its CUDA stream and staging buffer: made at
        a request's first load they cost that request ~1 ms a thread (measured on an H200,
        a fresh engine's 8k-token load)."""
        ready = threading.Barrier(self._num_threads)  # one task per thread: all wait here

        def start() -> None:
            ready.wait()
            self._mover.prepare_thread()
        for f in [self._io.submit(start) for _ in range(self._num_threads)]:
            f.result()

    def start_load_kv(self) -> None:
        meta: FsPoolMeta | None = self.get_connector_meta()
        if not meta:
            return
        for rid, num_blocks in meta.drops.items():
            queue = self._queues.get(rid)
            if queue is not None:
                queue.drop(num_blocks)
        by_request: dict[str, list[BlockTransfer]] = {}
        for t in meta.loads:
            by_request.setdefault(t.request_id, []).append(t)
        for rid, transfers in by_request.items():
            queue = self._queues[rid] = _LoadQueue(self._load_units(transfers))
            if self.is_async:  # a task per thread, each taking units until none is left
                futures = [self._io.submit(self._load_queue, queue)
                           for _ in range(min(self._num_threads, queue.num_units))]
            else:
                futures = [Future()]
                self._load_queue(queue)
                futures[0].set_result(None)
            self._loads.setdefault(rid, []).extend(futures)

    def _load_units(self, transfers: list[BlockTransfer]) -> list[list[BlockTransfer]]:
        """One request's loads (last block first) as units, in the order they are read: the
        blocks the host tier holds are one unit, first (its copies alone run at the H2D
        limit: many threads copying at once were half as fast, measured on an H200); the
        files follow, a page of blocks a unit (on a CPU without a tier, a few blocks)."""
        if self._mover is None:
            tier, files, per_unit = [], transfers, CPU_BLOCKS_PER_UNIT
        else:
            in_tier = self.tier.contains([shard_key(t.key, *self._shard) for t in transfers])
            tier = [t for t, hit in zip(transfers, in_tier) if hit]
            files = [t for t, hit in zip(transfers, in_tier) if not hit]
            per_unit = self.tier.blocks_per_page
        units = [tier, *(files[i:i + per_unit] for i in range(0, len(files), per_unit))]
        return [unit for unit in units if unit]

    def _load_queue(self, queue: _LoadQueue) -> None:
        """An I/O task: load the queue's units until none is left (or the rest is dropped)."""
        while (unit := queue.pop()) is not None:
            try:
                self._load_blocks(unit, queue)
            finally:  # its copies have ended, landed or failed
                queue.done(unit)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass  # whole blocks move before the request is scheduled

    def save_kv_layer(self, layer_idx: int) -> None:
        pass  # whole blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        """Start the step's saves; nothing here waits for a copy or a write."""
        meta: FsPoolMeta | None = self.get_connector_meta()
        if not meta or not meta.saves:
            return
        if self._mover is None:  # straight from the cache's memory
            for t in meta.saves:
                self._saves.setdefault(t.request_id, []).append(
                    self._io.submit(self._save_block, t, _bytes_of(self.kv[t.block_id])))
            return
        by_request: dict[str, list[BlockTransfer]] = {}
        for t in meta.saves:
            by_request.setdefault(t.request_id, []).append(t)
        per_page = self.tier.blocks_per_page
        for rid, transfers in by_request.items():
            for i in range(0, len(transfers), per_page):
                group = transfers[i:i + per_page]
                page, event = self._mover.begin_save([t.block_id for t in group])
                self._saves.setdefault(rid, []).append(self._writers.submit(
                    self._mover.finish_save, page, event,
                    [shard_key(t.key, *self._shard) for t in group],
                    lambda j, view, group=group: self._save_block(group[j], view)))

    def get_finished(self, saving_ids: list[str],
                     loading_ids: list[str]) -> tuple[set[str], set[str]]:
        # A save id is done once none of its copies is pending (also if it never had one).
        done_saving = {rid for rid in saving_ids if _all_done(self._saves.get(rid, ()))}
        done_loading = {rid for rid in loading_ids if rid in self._loads
                        and _all_done(self._loads[rid])}
        for rid in done_saving:
            self._saves.pop(rid, None)
        self._final = {rid: self._queues.pop(rid).progress() for rid in done_loading
                       if rid in self._queues}
        with self._lock:
            for rid in done_loading:
                self._loads.pop(rid, None)
                if rid in self._bad_block:
                    self._failed[rid] = self._bad_block.pop(rid)
        return done_saving, done_loading

    def abort(self, request_ids: list[str]) -> None:
        """Cancel the requests' queued I/O; wait for the I/O already running (a read or
        write of one block file or page, and its copies: bounded by the disk, not by the
        pool's other traffic). A paged save is never cancelled: its task is what lets go
        of the page its copy is writing."""
        running = []
        for rid in request_ids:
            queue = self._queues.pop(rid, None)
            if queue is not None:  # its running tasks read no other block
                queue.abort()
            self._final.pop(rid, None)
            running += [f for f in self._loads.pop(rid, ()) if not f.cancel()]
            saves = self._saves.pop(rid, ())
            running += (list(saves) if self._mover is not None
                        else [f for f in saves if not f.cancel()])
        wait(running)
        with self._lock:
            for rid in request_ids:
                self._bad_block.pop(rid, None)
                self._failed.pop(rid, None)

    def get_load_progress(self, loading_ids: list[str]) -> dict[str, LoadProgress]:
        progress = {}
        for rid in loading_ids:
            queue = self._queues.get(rid)
            if queue is not None:
                progress[rid] = queue.progress()
            elif rid in self._final:
                progress[rid] = self._final[rid]
        return progress

    def get_failed_loads(self) -> dict[str, int]:
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def stats(self) -> dict[str, float]:
        with self._lock:
            s = dict(self._stats)
        s["host_tier_hit_blocks"] = self.tier.num_hits if self.tier is not None else 0
        return s

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        if self._mover is not None:
            self._writers.shutdown(wait=True)
        self._dirs.close()
        if self.max_bytes is not None:
            # while running, the pool may pass max_bytes by what is written between trims
            # (a tenth of it) plus saves in flight; at the end it holds at most max_bytes
            self._trim()

    # -- I/O threads -------------------------------------------------------------------

    def _load_blocks(self, transfers: list[BlockTransfer], queue: _LoadQueue) -> None:
        """Load one unit; once its request is aborted, the blocks not read yet are skipped."""
        start = time.perf_counter()
        if self._mover is None:
            ok = sum(not queue.is_aborted
                     and self._read_block(t, self._block_bytes[t.block_id]) is not None
                     for t in transfers)
        else:  # through pages: blocks not read came from the tier
            failed = []

            def read(i: int, dest: memoryview) -> int | None:
                if queue.is_aborted:
                    failed.append(i)
                    return None
                checksum = self._read_block(transfers[i], dest, verify=not self._mover.verifies)
                if checksum is None:
                    failed.append(i)
                return checksum

            def corrupt(i: int) -> None:  # failed the GPU's verification
                failed.append(i)
                self._corrupt(transfers[i], pf.CorruptBlock("checksum",
                                                            "payload checksum mismatch"))
            self._mover.load([shard_key(t.key, *self._shard) for t in transfers],
                             [t.block_id for t in transfers], read, corrupt)
            ok = len(transfers) - len(failed)
        with self._lock:
            self._stats["bytes_loaded"] += ok * self.layout.block_nbytes
            self._stats["blocks_loaded"] += ok
            self._stats["load_seconds"] += time.perf_counter() - start

    def _read_block(self, t: BlockTransfer, dest: memoryview, verify: bool = True) -> int | None:
        """Read block `t`'s file into `dest`, verified unless `verify` is False (then the
        caller verifies it); the header's checksum of the payload, or None (the failure
        recorded, a corrupt file set aside) if it is missing, unreadable or fails."""
        key = shard_key(t.key, *self._shard)
        path = pf.block_path_str(self._root_str, key)
        if path in UNUSABLE_FILES:  # corrupt, and still there: never read again
            self._record_failure(t, "missing_blocks")
            return None
        if self._throttle is not None:
            self._throttle.wait(self.layout.block_nbytes)
        try:
            return pf.read_block_into(self.root, self.namespace, key, dest, self.block_shape,
                                      self.dtype, touch_after=self._touch_after,
                                      dirs=self._dirs, verify=verify)
        except pf.BlockMissing:
            self._record_failure(t, "missing_blocks")
        except pf.CorruptBlock as e:
            self._corrupt(t, e)
        except OSError as e:
            log.warning("pool block %s could not be read: %s", key.hex(), e)
            self._record_failure(t, "missing_blocks")
        return None

    def _corrupt(self, t: BlockTransfer, error: pf.CorruptBlock) -> None:
        """Block `t`'s file failed verification: set aside, the failure recorded."""
        key = shard_key(t.key, *self._shard)
        self._set_aside(key, pf.block_path_str(self._root_str, key), error)
        self._record_failure(t, "corrupt_blocks")

    def _set_aside(self, key: bytes, path: str, error: pf.CorruptBlock) -> None:
        """Quarantine a corrupt file; one that cannot be moved (a read-only pool, quarantine/
        replaced by a link) is remembered instead. Either way the block is recomputed."""
        try:
            pf.quarantine(self.root, key, error.reason)
        except OSError as e:
            UNUSABLE_FILES.add(path)
            log.warning("pool block %s is corrupt (%s) and cannot be quarantined (%s): "
                        "skipped for the rest of this process, recomputing", key.hex(), error, e)
            return
        log.warning("pool block %s is corrupt (%s): quarantined, recomputing", key.hex(), error)

    def _trim(self) -> None:
        """Trim to max_bytes; a failure (a read-only pool, a directory replaced by a link) is
        logged, never fatal: a pool past its cap still serves verified blocks."""
        try:
            trim_pool(self.root, self.max_bytes)
        except OSError as e:
            log.warning("pool trim to %d bytes failed: %s", self.max_bytes, e)

    def _record_failure(self, t: BlockTransfer, counter: str) -> None:
        with self._lock:
            self._stats[counter] += 1
            prev = self._bad_block.get(t.request_id)
            self._bad_block[t.request_id] = t.block_index if prev is None else min(prev, t.block_index)

    def _save_block(self, t: BlockTransfer, payload: memoryview) -> bool:
        """Publish one block from `payload`; True if the pool has it now."""
        start = time.perf_counter()
        key = shard_key(t.key, *self._shard)
        try:
            written = pf.write_block(self.root, self.namespace, key, payload,
                                     self.block_shape, self.dtype, self._dirs)
        except OSError as e:
            log.warning("pool save of block %s failed: %s", key.hex(), e)
            with self._lock:
                self._stats["save_failures"] += 1
            return False
        nbytes = payload.nbytes
        with self._lock:
            self._stats["save_seconds"] += time.perf_counter() - start
            if written:
                self._stats["bytes_saved"] += nbytes
                self._stats["blocks_saved"] += 1
                self._bytes_since_trim += nbytes
            trim = self.max_bytes is not None and self._bytes_since_trim > self.max_bytes // 10
            if trim:
                self._bytes_since_trim = 0
        if trim:
            self._trim()
        return True


class _LoadQueue:
    """One request's load as units (lists of blocks), taken by I/O tasks in order (last
    blocks first), and what has become of each of its blocks. Thread-safe."""

    QUEUED, RUNNING, LANDED = 1, 2, 3

    def __init__(self, units: list[list[BlockTransfer]]):
        self._units = deque(units)
        self.num_units = len(units)
        indices = [t.block_index for unit in units for t in unit]
        self.first, self.end = min(indices), max(indices) + 1
        self._state = [0] * (self.end - self.first)  # per block from `first`: 0 = not loaded
        for i in indices:
            self._state[i - self.first] = self.QUEUED
        self._lock = threading.Lock()
        self.is_aborted = False  # the units running skip the blocks they have not read

    def abort(self) -> None:
        self.drop(self.end)
        self.is_aborted = True

    def pop(self) -> list[BlockTransfer] | None:
        with self._lock:
            if not self._units:
                return None
            unit = self._units.popleft()
            self._mark(unit, self.RUNNING)
            return unit

    def done(self, unit: list[BlockTransfer]) -> None:
        with self._lock:
            self._mark(unit, self.LANDED)

    def drop(self, num_blocks: int) -> None:
        """Take the queued units that lie wholly below block `num_blocks` off the queue."""
        with self._lock:
            keep = deque()
            for unit in self._units:
                if max(t.block_index for t in unit) < num_blocks:
                    self._mark(unit, 0)
                else:
                    keep.append(unit)
            self._units = keep

    def progress(self) -> LoadProgress:
        with self._lock:
            state = self._state
            landed = len(state)
            while landed > 0 and state[landed - 1] == self.LANDED:
                landed -= 1
            pending = next((i for i, s in enumerate(state)
                            if s in (self.QUEUED, self.RUNNING)), None)
            writes_from = landed if pending is None else pending
            return LoadProgress(self.first + writes_from, self.first + landed)

    def _mark(self, unit: list[BlockTransfer], state: int) -> None:
        for t in unit:
            self._state[t.block_index - self.first] = state


class _Throttle:
    """Paces reads to a rate shared by every thread: each read waits for its turn."""

    def __init__(self, gbps: float):
        self._bytes_per_s = gbps * 1e9
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self._bytes_per_s
        if start > now:
            time.sleep(start - now)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's memory as a writable byte view (no copy; t must be contiguous on CPU)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _all_done(futures) -> bool:
    """All finished; an I/O task that raised (not a handled miss or write failure: a bug or
    a broken buffer) raises here, in the poll, which makes it the engine's fatal failure."""
    if not all(f.done() for f in futures):
        return False
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise RuntimeError(f"pool I/O failed: {type(f.exception()).__name__}: "
                               f"{f.exception()}") from f.exception()
    return True
