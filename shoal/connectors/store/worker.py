"""The worker side of a store-backed pool connector: moves blocks between a store and the
KV cache, off the engine thread.

With a GPU cache (or a host tier) blocks move through pinned host pages, a page at a
time, with copies on side streams (store/paged_io.py); on a GPU the blocks read are
verified there, after the copy (store/gpu_xxh3.py), where Triton is present. On a CPU
without a tier they are read straight into, and written straight from, the KV cache's
memory.

Loads are partial (SPEC 3.1): a request's blocks are read last first, a unit (a page, or
a few blocks) at a time, by as many I/O threads as there are units; the engine's drops
take the units no thread has started off the queue, and `get_load_progress` says which
blocks may still be written and which have landed. A block that is missing, fails its
check or cannot be read (the store is down) is a failed load from that block: the engine
recomputes it; a corrupt one is set aside first. A save that fails is counted, never
fatal.
"""

from __future__ import annotations

import abc
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   KvConnectorWorker, LoadProgress)
from shoal.connectors.store.host_tier import HostTier, tier_shape
from shoal.connectors.store.paged_io import PagedMover
from shoal.connectors.store.base import BlockSpec, BlockStore, PoolOptions
from shoal.connectors.store.load_queue import LoadQueue, Throttle
from shoal.connectors.store.scheduler import BlockTransfer, PoolMeta
from shoal.connectors.store.unit_io import UnitIO
from shoal.kv.block_keys import shard_key, shard_namespace

log = logging.getLogger(__name__)

# A load unit: what one I/O thread reads before it takes the next. On a CPU without a
# tier, a few blocks, so that the units all threads hold at once are a small part of a
# load and a drop takes most of what the engine's front reaches. Through the tier, a page:
# units of 1-4 blocks loaded an 8k-token Llama-1B hit at a third of the rate of pages on
# an H200 (a copy, a check and a wait per unit); there the admission's split does the work.
CPU_BLOCKS_PER_UNIT = 4


class StoreWorker(UnitIO, KvConnectorWorker):
    supports_attention_dp = True
    supports_abort = True  # I/O not started is cancelled; I/O in progress is waited for
    supports_partial_loads = True

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        super().__init__(config, ctx)
        self.store, opts = self.open_store(config, ctx.device)
        self.is_async = opts.is_async
        self._tier_bytes = opts.host_tier_bytes
        # the shard this rank holds (TP), named in its blocks' keys and headers
        self._shard = (ctx.shard_rank, ctx.num_shards)
        self.namespace = shard_namespace(bytes.fromhex(ctx.namespace), *self._shard)
        self._num_threads = opts.io_threads
        self._io = ThreadPoolExecutor(self._num_threads, thread_name_prefix="shoal-pool-io")
        self._lock = threading.Lock()
        self._loads: dict[str, list[Future]] = {}
        self._queues: dict[str, LoadQueue] = {}  # rid -> its pending load's units
        self._final: dict[str, LoadProgress] = {}  # loads reported finished by the last poll
        self._throttle = None if opts.max_read_gbps is None else Throttle(opts.max_read_gbps)
        self._saves: dict[str, list[Future]] = {}
        self._bad_blocks: dict[str, list[int]] = {}  # rid -> failed blocks (loads pending)
        self._moved = threading.Event()  # set when a unit lands or a task ends
        self._failed: dict[str, int] = {}  # failures of loads reported finished
        self._stats = dict(bytes_loaded=0, bytes_saved=0, load_seconds=0.0, save_seconds=0.0,
                           corrupt_blocks=0, missing_blocks=0, save_failures=0,
                           blocks_loaded=0, blocks_saved=0)
        self.tier: HostTier | None = None
        self._mover: PagedMover | None = None

    @classmethod
    @abc.abstractmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        """The store the options name, and the shared options; ValueError naming a bad one."""

    def register_kv_caches(self, kv_caches: KVCacheRegistration) -> None:
        self.kv = kv_caches.tensor
        self.layout = kv_caches.layout
        nbytes = kv_caches.layout.block_nbytes
        self.spec = BlockSpec(self.namespace, tuple(kv_caches.layout.block_shape),
                              kv_caches.layout.dtype, nbytes)
        self.on_cpu = self.kv.device.type == "cpu"
        self.store.warm_up(self._num_threads)
        # on a GPU every copy is staged in pages: enough for all threads at once
        num_pages, per_page = tier_shape(self._tier_bytes, nbytes,
                                         0 if self.on_cpu else 4 * (self._num_threads + 1))
        if num_pages:  # (a capped read rate paces the threads' reads: no read processes)
            if self.store.read_processes and self._throttle is None:
                self._start_read_processes(nbytes, num_pages, per_page)
            if self.tier is None:
                self.tier = HostTier(nbytes, num_pages, per_page, pinned=not self.on_cpu)
            self._mover = PagedMover(self.kv, self.tier)
            # saves are finished on threads of their own (paged_io: why that cannot hang); few:
            # each block written costs Python under the GIL, which the launches wait for
            self._writers = ThreadPoolExecutor(max(1, self._num_threads // 4),
                                               thread_name_prefix="shoal-pool-write")
            self._block_bytes = []
            if self._mover.is_cuda:
                self._start_io_threads()
                self._mover.warm_up()
        else:  # byte views of every block, made once: loads read straight into block memory
            self._block_bytes = [_bytes_of(self.kv[i]) for i in range(len(self.kv))]

    def _start_read_processes(self, nbytes: int, num_pages: int, per_page: int) -> None:
        """A shared tier and the store's read processes; if either cannot be had, a warning
        (the I/O threads read, through a tier of their own)."""
        tier = None
        try:
            tier = HostTier(nbytes, num_pages, per_page, pinned=not self.on_cpu, shared=True)
            # (sync loads: one thread reads, inside start_load_kv)
            self.store.start_read_processes(self.spec, tier,
                                            self._num_threads if self.is_async else 1)
            self.tier = tier
        except (OSError, RuntimeError) as e:
            log.warning("pool read processes not started (%s): the I/O threads read", e)
            if tier is not None:
                tier.close()

    def _start_io_threads(self) -> None:
        """Start every I/O thread now, each with its CUDA stream and staging buffer: made at
        a request's first load they cost that request ~1 ms a thread (H200, 8k tokens)."""
        ready = threading.Barrier(self._num_threads)  # one task per thread: all wait here

        def start() -> None:
            ready.wait()
            self._mover.prepare_thread()
        for f in [self._io.submit(start) for _ in range(self._num_threads)]:
            f.result()

    def _key(self, t: BlockTransfer) -> bytes:
        """The key of this rank's shard of block `t` in the store."""
        return shard_key(t.key, *self._shard)

    def start_load_kv(self) -> None:
        if self._mover is not None and self.is_async:  # the forward is launched next (until
            self._mover.launching(True)  # wait_for_save; sync loads run on this thread)
        meta: PoolMeta | None = self.get_connector_meta()
        if not meta:
            return
        for rid, num_blocks in meta.drops.items():
            queue = self._queues.get(rid)
            if queue is not None:
                queue.drop(num_blocks)
        by_request: dict[str, list[BlockTransfer]] = {}
        for t in meta.loads:
            by_request.setdefault(t.request_id, []).append(t)
        # (on a GPU: the copies wait for the steps launched so far, not for this one's)
        after = self._mover.fence() if self._mover is not None and by_request else None
        for rid, transfers in by_request.items():
            # reads straight into the cache can stop between blocks; a mover's copies cannot
            queue = self._queues[rid] = LoadQueue(self._load_units(transfers),
                                                  per_block=self._mover is None, after=after)
            if self.is_async:  # a task per thread, each taking units until none is left
                futures = [self._submit(self._io, self._load_queue, queue)
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
        store's follow, a page of blocks a unit (on a CPU without a tier, a few blocks)."""
        if self._mover is None:
            tier, stored, per_unit = [], transfers, CPU_BLOCKS_PER_UNIT
        else:
            in_tier = self.tier.contains([self._key(t) for t in transfers])
            tier = [t for t, hit in zip(transfers, in_tier) if hit]
            stored = [t for t, hit in zip(transfers, in_tier) if not hit]
            per_unit = self.tier.blocks_per_page
        units = [tier, *(stored[i:i + per_unit] for i in range(0, len(stored), per_unit))]
        return [unit for unit in units if unit]

    def _load_queue(self, queue: LoadQueue) -> None:
        """An I/O task: load the queue's units until none is left (or the rest is dropped)."""
        while (unit := queue.pop()) is not None:
            try:
                self._load_blocks(unit, queue)
            finally:  # its copies have ended, landed or failed
                queue.done(unit)
                self._moved.set()

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future:
        """fn(*args) on one of the pool's threads; its end wakes `wait_for_transfers`."""
        future = pool.submit(fn, *args)
        future.add_done_callback(lambda _: self._moved.set())
        return future

    def wait_for_transfers(self, timeout: float) -> None:
        """Until a unit landed or an I/O task ended since the last poll began (or `timeout`):
        an engine that only waits for loads polls when they moved, not every 0.5 ms (its
        polls run Python while the I/O threads need the GIL back after each read)."""
        self._moved.wait(timeout)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass  # whole blocks move before the request is scheduled

    def save_kv_layer(self, layer_idx: int) -> None:
        pass  # whole blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        """Start the step's saves; nothing here waits for a copy or a write."""
        if self._mover is not None:  # the forward is launched
            self._mover.launching(False)
        meta: PoolMeta | None = self.get_connector_meta()
        if not meta or not meta.saves:
            return
        if self._mover is None:  # straight from the cache's memory
            for t in meta.saves:
                self._saves.setdefault(t.request_id, []).append(self._submit(
                    self._io, self._save_block, t, _bytes_of(self.kv[t.block_id])))
            return
        by_request: dict[str, list[BlockTransfer]] = {}
        for t in meta.saves:
            by_request.setdefault(t.request_id, []).append(t)
        per_page = self.tier.blocks_per_page
        for rid, transfers in by_request.items():
            for i in range(0, len(transfers), per_page):
                group = transfers[i:i + per_page]
                page, event = self._mover.begin_save([t.block_id for t in group])
                self._saves.setdefault(rid, []).append(self._submit(
                    self._writers, self._mover.finish_save, page, event,
                    [self._key(t) for t in group],
                    lambda j, view, group=group: self._save_block(group[j], view)))

    def get_finished(self, saving_ids: list[str],
                     loading_ids: list[str]) -> tuple[set[str], set[str]]:
        self._moved.clear()  # what moves from now on, this poll may not see: wake the wait
        # A save id is done once none of its copies is pending (also if it never had one).
        done_saving = {rid for rid in saving_ids if _all_done(self._saves.get(rid, ()))}
        done_loading = {rid for rid in loading_ids if rid in self._loads
                        and _all_done(self._loads[rid])}
        for rid in done_saving:
            self._saves.pop(rid, None)
        queues = {rid: self._queues.pop(rid) for rid in done_loading if rid in self._queues}
        self._final = {rid: queue.progress() for rid, queue in queues.items()}
        with self._lock:
            for rid in done_loading:
                self._loads.pop(rid, None)
                failed = self._bad_blocks.pop(rid, ())
                bad = queues[rid].first_bad(failed) if rid in queues else min(failed, default=None)
                if bad is not None:
                    self._failed[rid] = bad
        return done_saving, done_loading

    def abort(self, request_ids: list[str]) -> None:
        """Cancel the requests' queued I/O; wait for the I/O already running (a read or
        write of one block or page, and its copies: bounded by the store, not by the
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
                self._bad_blocks.pop(rid, None)
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
        return {**s, **self.store.stats()}

    def shutdown(self) -> None:
        if self._mover is not None:  # (a step that failed may have left the gate closed)
            self._mover.launching(False)
        self._io.shutdown(wait=True)
        if self._mover is not None:
            self._writers.shutdown(wait=True)
        self.store.close()
        if self.tier is not None:
            self.tier.close()


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
