"""The scheduler side of a store-backed pool connector: which blocks to load and save.

Only full prompt blocks move (the engine's `block_keys`). A request's load covers the
longest run of consecutive pool hits after its local prefix hit, looked up in one call
to the store (one pipelined round trip for a network store), and is planned last block
first (SPEC 3.1); `drop_loads` takes the blocks the engine computes itself off the plan.
A block is saved by the step that completes it, unless the pool has it already: one
lookup per step for every block completed in it, but none for a key that lookup found in
the last RECHECK_SECONDS (each 8k-token local prefix hit looked up its 512 files again:
~2 ms of the engine thread, CPU; a key trimmed from the store meanwhile is saved again
once that has passed), nor for one sent to be saved in the last SAVE_RECHECK_SECONDS
(its write may still be queued); then it is looked up: found, or saved again (its save
failed). A hit's keys are not taken as found: the lookup of a run is a hint. The keys
this side sent to the worker (loads and saves) are remembered, newest last, as many as
the worker's host tier holds: what the tier probably has (`get_num_matched_host_tokens`,
which the engine's split weighs). Under TP each rank's worker stores its shard under
`shard_key(key, rank, world_size)`; this side (rank 0) counts a block as a hit only if
every shard is in the store, and saves it if any is missing.
"""

from __future__ import annotations

import abc
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KvConnectorScheduler,
                                   RequestView, SchedulerOutput)
from shoal.connectors.store.base import BlockStore, PoolOptions
from shoal.kv.block_keys import shard_key

KNOWN_KEYS = 1 << 16  # keys remembered as found or saved (the newest)
RECHECK_SECONDS = 60.0  # a key found in the store is not looked up again for this long
SAVE_RECHECK_SECONDS = 10.0  # nor one sent to be saved (a failed save is retried after it)


@dataclass(frozen=True)
class BlockTransfer:
    request_id: str
    block_index: int  # position of the block in the request (block i = tokens i*bs ...)
    block_id: int  # where it lives in the local KV cache
    key: bytes


@dataclass
class PoolMeta:
    """One step's plan."""

    loads: list[BlockTransfer] = field(default_factory=list)  # store -> KV, last block first
    saves: list[BlockTransfer] = field(default_factory=list)  # KV -> store
    drops: dict[str, int] = field(default_factory=dict)  # rid -> its loads below this block
    # index are dropped (the engine computes them)


@dataclass
class _RequestState:
    block_ids: list[int]
    num_checked: int = 0  # leading full blocks already considered for saving
    loading: range = range(0)  # blocks of its load (planned at admission)
    dropped_to: int = 0  # blocks of it below this index the engine computes (in the pool)
    has_saves: bool = False
    saved_keys: list[bytes] = field(default_factory=list)  # saves scheduled for it


class StoreScheduler(KvConnectorScheduler):
    supports_attention_dp = True
    supports_partial_loads = True

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext):
        super().__init__(config, ctx)
        self.store, opts = self.open_store(config, ctx.device)
        self.is_async = opts.is_async
        self._num_shards = ctx.num_shards
        self._matched: dict[str, tuple[int, int]] = {}  # rid -> (first block, num blocks)
        self._loading: dict[str, range] = {}  # rid -> blocks of the load planned at admission
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[BlockTransfer] = []
        self._drops: dict[str, int] = {}  # rid -> drop bound for loads already planned
        self._dropped_to: dict[str, int] = {}  # drops of requests not yet in a plan
        self._saving_keys: set[bytes] = set()  # saves scheduled by live requests
        self._stats = dict(pool_lookups=0, pool_hit_blocks=0, pool_miss_blocks=0)
        # keys the worker's host tier probably holds (the newest last), and what it holds
        self._in_host: OrderedDict[bytes, None] = OrderedDict()
        self._host_capacity = opts.host_tier_bytes // ctx.block_nbytes if ctx.block_nbytes else 0
        self._host_matched: dict[str, int] = {}  # rid -> of its last match, blocks in the tier
        self._known: OrderedDict[bytes, float] = OrderedDict()  # key -> not looked up until

    @classmethod
    @abc.abstractmethod
    def open_store(cls, config: ConnectorConfig, device: str) -> tuple[BlockStore, PoolOptions]:
        """The store the options name, and the shared options; ValueError naming a bad one."""

    def get_num_new_matched_tokens(self, request: RequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.ctx.block_size
        first = num_computed_tokens // bs
        last = min((len(request.prompt_token_ids) - 1) // bs,  # never the last token's block
                   len(request.block_keys))
        found = self._in_pool(request.block_keys[first:last], stop_at_miss=True)
        hits = next((i for i, hit in enumerate(found) if not hit), len(found))
        self._stats["pool_lookups"] += 1
        self._stats["pool_hit_blocks"] += hits
        self._stats["pool_miss_blocks"] += max(last - first - hits, 0)
        if hits == 0:
            self._matched.pop(request.request_id, None)
            self._host_matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (first, hits)
        self._host_matched[request.request_id] = sum(
            k in self._in_host for k in request.block_keys[first:first + hits])
        return hits * bs, self.is_async

    def get_num_matched_host_tokens(self, request: RequestView) -> int:
        return self._host_matched.get(request.request_id, 0) * self.ctx.block_size

    def _remember(self, transfers: list[BlockTransfer]) -> None:
        """Keys just sent to the worker: its tier will hold them (the oldest drop out)."""
        if not self._host_capacity:
            return
        for t in transfers:
            self._in_host[t.key] = None
            self._in_host.move_to_end(t.key)
        while len(self._in_host) > self._host_capacity:
            self._in_host.popitem(last=False)

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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PoolMeta:
        meta = PoolMeta(loads=self._pending_loads, drops=self._drops)
        self._pending_loads, self._drops = [], {}
        for rd in scheduler_output.new_requests:
            prev = self._requests.get(rd.request_id)
            self._requests[rd.request_id] = _RequestState(
                list(rd.new_block_ids), has_saves=prev is not None and prev.has_saves,
                saved_keys=[] if prev is None else prev.saved_keys,
                loading=self._loading.pop(rd.request_id, range(0)),
                dropped_to=self._dropped_to.pop(rd.request_id, 0))
        for rd in scheduler_output.cached_requests:
            self._requests[rd.request_id].block_ids.extend(rd.new_block_ids)
        candidates = self._completed_blocks(scheduler_output)
        found = self._in_pool([key for _, _, key in candidates])
        self._know([key for (_, _, key), in_pool in zip(candidates, found) if in_pool],
                   RECHECK_SECONDS)
        for (rid, i, key), in_pool in zip(candidates, found):
            if in_pool or key in self._saving_keys:  # (the same block twice in one step)
                continue
            st = self._requests[rid]
            self._saving_keys.add(key)
            st.saved_keys.append(key)
            meta.saves.append(BlockTransfer(rid, i, st.block_ids[i], key))
            st.has_saves = True
        self._know([t.key for t in meta.saves], SAVE_RECHECK_SECONDS)
        self._remember(meta.loads)
        self._remember(meta.saves)
        return meta

    def _completed_blocks(self, scheduler_output: SchedulerOutput
                          ) -> list[tuple[str, int, bytes]]:
        """(request id, block index, key) of the blocks this step completes that may have
        to be saved; each block of a request is considered once."""
        bs = self.ctx.block_size
        out, now = [], time.monotonic()
        for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            st = self._requests[rd.request_id]
            computed = rd.computed_position // bs
            full = min((rd.computed_position + rd.num_scheduled_tokens) // bs,
                       len(rd.block_keys), len(st.block_ids))
            for i in range(st.num_checked, full):
                # a block of the hit that was loaded before this step's chunk, or that the
                # engine computes instead of loading it, is in the pool: no need to look it
                # up again (a block the load failed is first checked in the step that
                # recomputes it: looked up, saved); nor one outside it found or saved lately
                key = rd.block_keys[i]
                if not ((i < computed or i < st.dropped_to) if i in st.loading else
                        now < self._known.get(key, -math.inf)) and key not in self._saving_keys:
                    out.append((rd.request_id, i, key))
            st.num_checked = max(st.num_checked, full)
        return out

    def _know(self, keys: list[bytes], seconds: float) -> None:
        """Keys not to look up for `seconds` (just found in the store, or sent to be saved);
        the oldest beyond KNOWN_KEYS are forgotten."""
        until = time.monotonic() + seconds
        for key in keys:
            self._known[key] = until
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    def _in_pool(self, keys: list[bytes], stop_at_miss: bool = False) -> list[bool]:
        """Whether every shard of each block is in the store (one call for all of them)."""
        n = self._num_shards
        if n == 1:
            return self.store.contains(keys, stop_at_miss)
        found = self.store.contains([shard_key(k, r, n) for k in keys for r in range(n)],
                                    stop_at_miss, group=n)
        return [all(found[i * n:(i + 1) * n]) for i in range(len(found) // n)]

    def request_finished(self, request: RequestView, block_ids: list[int]) -> bool:
        self._matched.pop(request.request_id, None)
        self._host_matched.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._dropped_to.pop(request.request_id, None)
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return False
        # the blocks are in the store or being written: later requests find them (a rare
        # duplicate write of an in-flight key is harmless: publishing never overwrites)
        self._saving_keys.difference_update(st.saved_keys)
        return st.has_saves

    def stats(self) -> dict[str, float]:
        return {**self._stats, **self.store.stats()}

    def shutdown(self) -> None:
        self.store.close()
