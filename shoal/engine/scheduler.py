"""Continuous batching with chunked prefill and preemption by recompute (one owner)."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.transfers import ConnectorManager, TransferReport
from shoal.kv.kv_cache_manager import KVCacheManager, cdiv
from shoal.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """The slice of one request computed by a step."""

    request: Request
    start: int  # first position computed (num_computed_tokens before this step)
    num_tokens: int  # positions [start, start + num_tokens) run through the model
    token_ids: list[int]  # known ids of those positions; the trailing placeholders are missing
    num_placeholders: int  # trailing positions whose ids the step in flight samples (overlap)
    block_ids: list[int]  # snapshot of the request's blocks when scheduled
    samples: bool  # the chunk reaches the end of the known tokens: sample one token
    epoch: int  # request.num_preemptions when scheduled (a later preemption makes it stale)


@dataclass
class ScheduledBatch:
    """What one step computes."""

    chunks: list[ScheduledChunk]
    num_tokens: int  # sum of chunk.num_tokens (<= max_num_tokens)
    num_preempted: int  # requests preempted while building this batch
    connector_meta: Any = None  # the connector's plan for this step (None without one)
    saving_ids: list[str] = field(default_factory=list)  # pending saves to poll after it
    save_epochs: dict[str, int] = field(default_factory=dict)  # their episodes at launch
    dp_token_counts: list[int] | None = None  # ADP: every owner's num_tokens this step
    loading_ids: list[str] = field(default_factory=list)  # pending loads to poll after it
    deadlines: dict[str, float] = field(default_factory=dict)  # of those transfers, at launch

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def is_padding(self) -> bool:
        """ADP: nothing to compute here, but a peer computes, so this owner joins the forward
        with zero tokens (no KV allocated, no connector call)."""
        return self.is_empty and bool(self.dp_token_counts) and any(self.dp_token_counts)

    @property
    def has_transfers(self) -> bool:
        """The connector has something to do or poll even if nothing is computed."""
        return bool(self.saving_ids or self.loading_ids)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_tokens: int, max_batch_size: int,
                 max_model_len: int, connector: ConnectorManager | None = None):
        self.kv = kv
        self.connector = connector
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        # A request may grow only as far as the cache holds it alone: past that it could
        # never run, so it stops with "length" like at the end of the context.
        self.max_request_len = min(max_model_len, kv.pool.num_blocks * kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # WAITING_FOR_LOAD: blocks held, in no batch
        self.saving: dict[str, Request] = {}  # SAVING: finished, blocks held for a save
        self._deferred_free: list[Request] = []  # finished while a later step may touch blocks
        self._cancelling: set[str] = set()  # cancelled while a load was pending
        self.num_preemptions = 0
        self.num_cancellations = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.saving
                    or (self.connector is not None and self.connector.has_pending_saves))

    def add(self, req: Request) -> str | None:
        """Queue a request; returns an error message (and queues nothing) if it can never run."""
        if not req.prompt_token_ids:
            return "the prompt is empty"
        if req.num_prompt_tokens > self.max_model_len:
            return (f"the prompt has {req.num_prompt_tokens} tokens, more than the model's "
                    f"context of {self.max_model_len}")
        if req.num_prompt_tokens > self.max_request_len:
            need = cdiv(req.num_prompt_tokens, self.kv.block_size)
            return (f"the prompt needs {need} KV blocks, more than the cache's "
                    f"{self.kv.pool.num_blocks}")
        self.kv.update_block_keys(req)
        self.waiting.append(req)
        return None

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_tokens
        chunks: list[ScheduledChunk] = []
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(self._num_schedulable(req), budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()  # the newest request yields first
                self._preempt(victim)
                num_preempted += 1
                if victim is req:
                    break
            else:
                chunks.append(self._make_chunk(req, num_new))
                budget -= num_new
                i += 1
        while (self.waiting and budget > 0 and not num_preempted
               and len(self.running) + len(self.loading) < self.max_batch_size):
            req = self.waiting[0]
            assert req.num_inflight_tokens == 0 and not req.block_ids, req.request_id
            hits = self.kv.find_cached_prefix(req)
            num_cached = len(hits) * self.kv.block_size
            num_external = self.connector.match(req, num_cached)[0] if self.connector else 0
            # A pool load fills its blocks first; the request computes from the next step on
            # (so a failed load is known before any forward reads those blocks).
            num_new = num_external or min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, num_new, hits):
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_local_prefix_tokens is None:
                req.num_local_prefix_tokens = num_cached
            if self.connector:
                self.connector.after_alloc(req, num_cached, num_external)
            if num_external:
                req.status = RequestStatus.WAITING_FOR_LOAD
                self.loading[req.request_id] = req
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._make_chunk(req, num_new))
            budget -= num_new
        batch = ScheduledBatch(chunks, self.max_num_tokens - budget, num_preempted)
        if self.connector:
            batch.connector_meta = self.connector.build_meta(chunks)
            batch.save_epochs = self.connector.pending_saves()
            batch.saving_ids, batch.loading_ids = list(batch.save_epochs), list(self.loading)
            batch.deadlines = self.connector.deadlines([*batch.saving_ids, *batch.loading_ids])
        return batch

    def update(self, batch: ScheduledBatch, sampled: list[int], defer_free: bool) -> list[Request]:
        """Apply a finished step: register computed blocks, append samples, finish requests.

        `sampled` holds one token per sampling chunk, in chunk order. With defer_free the
        blocks of requests finishing now are released at the next update (a step already in
        flight may still write them)."""
        self.release_deferred()
        finished = []
        tokens = iter(sampled)
        for chunk in batch.chunks:
            req = chunk.request
            is_current = chunk.epoch == req.num_preemptions and req.status == RequestStatus.RUNNING
            if is_current:
                self.kv.cache_computed_blocks(req, chunk.start + chunk.num_tokens)
            if not chunk.samples:
                continue
            token = next(tokens)
            req.num_inflight_tokens -= 1
            if req.is_finished:
                continue  # the overlap loop ran one step past a stop token
            req.output_token_ids.append(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason, defer_free=defer_free)
                finished.append(req)
        return finished

    def finish(self, req: Request, reason: str, error: str | None = None,
               defer_free: bool = False) -> None:
        """End a request: out of the queues, blocks released (now or at the next update)."""
        if self.connector is not None and self.connector.is_loading(req.request_id):
            # never free blocks a load may still write (its end comes through apply_transfers)
            self.connector.fail("refused to free the blocks of a request whose load is still "
                                "pending", req.request_id)
            return
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_LOAD:
            del self.loading[req.request_id]
        if self.connector is not None and self.connector.on_finish(req):
            req.status = RequestStatus.SAVING  # blocks stay held until the save is reported
            self.saving[req.request_id] = req
            return
        req.status = RequestStatus.FINISHED
        self._release(req, defer_free)

    def cancel(self, req: Request, defer_free: bool) -> bool:
        """End `req` as "cancelled"; True if it ended now (possibly SAVING: a pending save
        keeps its blocks pinned until it drains). A request whose load is pending keeps its
        blocks and ends when the load drains (apply_transfers returns it then). Either way
        the transfer gets at most the grace from now."""
        if req.is_finished or req.request_id in self._cancelling:
            return False
        self.num_cancellations += 1
        loading = req.status == RequestStatus.WAITING_FOR_LOAD
        if loading:
            self._cancelling.add(req.request_id)
        else:
            self.finish(req, "cancelled", defer_free=defer_free)
        if self.connector is not None:  # the load, or the saves pending now (incl. pinned)
            self.connector.shorten_deadline(req.request_id)
        return not loading

    def apply_transfers(self, batch: ScheduledBatch, report: TransferReport,
                        defer_free: bool) -> list[Request]:
        """Finished loads join the running requests (or fail); finished saves release their
        blocks; aborted transfers end their requests with an error. Returns requests that
        ended here."""
        ended = self._apply_aborts(report, defer_free)
        for rid in sorted(report.finished_loading):
            req = self.loading.get(rid)
            if req is None:
                continue  # reported by an earlier poll already (the overlap loop polls twice)
            num_ok, error = self.connector.load_result(req, report)
            if rid in self._cancelling:
                self._cancelling.discard(rid)
                self.finish(req, "cancelled", defer_free=defer_free)
                ended.append(req)
                continue
            if error is not None:
                self.finish(req, "error", error, defer_free)  # leaves self.loading there
                ended.append(req)
                continue
            del self.loading[rid]
            req.status = RequestStatus.RUNNING
            req.num_connector_tokens = num_ok - req.num_computed_tokens
            req.num_computed_tokens = num_ok
            self.kv.cache_computed_blocks(req, num_ok)
            self.running.append(req)
        for rid in sorted(report.finished_saving):
            epoch = batch.save_epochs.get(rid)
            if epoch is None or not self.connector.save_reported(rid, epoch):
                continue  # not asked, or about an earlier episode
            req = self.saving.pop(rid, None)
            if req is not None:
                req.status = RequestStatus.FINISHED
                self._release(req, defer_free)
        return ended

    def _apply_aborts(self, report: TransferReport, defer_free: bool) -> list[Request]:
        """The worker gave up these transfers (deadline passed; nothing of them runs now)."""
        ended = []
        for rid in sorted(report.aborted):
            req = self.loading.get(rid)
            if req is not None:
                self.connector.load_aborted(rid)
                cancelled = rid in self._cancelling
                self._cancelling.discard(rid)
                self.finish(req, "cancelled" if cancelled else "error",
                            None if cancelled else "the KV load did not finish within its "
                            "deadline and was aborted", defer_free)
                ended.append(req)
            if self.connector.save_aborted(rid):
                req = self.saving.pop(rid, None)
                if req is not None:  # its tokens stand; the save is what failed
                    if req.finish_reason != "cancelled":
                        req.finish_reason = "error"
                        req.error = "the KV save did not finish within its deadline and was aborted"
                    req.status = RequestStatus.FINISHED  # ended (and was returned) before
                    self._release(req, defer_free)
        return ended

    def _release(self, req: Request, defer_free: bool) -> None:
        if req.block_ids and defer_free:
            self._deferred_free.append(req)
        elif req.block_ids:
            self.kv.free(req)

    def release_deferred(self) -> None:
        """Free blocks held back for a step in flight (call once no step is in flight)."""
        ready, self._deferred_free = self._deferred_free, []
        for req in ready:
            self.kv.free(req)

    def check_integrity(self) -> None:
        """Every block reference is held by exactly one live request; queues are consistent."""
        self.kv.check_integrity()
        holders = [*self.running, *self._deferred_free, *self.loading.values(),
                   *self.saving.values()]
        refs = Counter(b for req in holders for b in req.block_ids)
        if self.connector is not None:
            refs.update(self.connector.pinned_block_refs())
        for block in self.kv.pool.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {refs[block.block_id]} requests")
        for req in self.waiting:
            assert req.status == RequestStatus.WAITING and not req.block_ids, req.request_id
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, req.request_id
            assert len(req.block_ids) * self.kv.block_size >= req.num_computed_tokens, (
                f"{req.request_id}: {len(req.block_ids)} blocks for "
                f"{req.num_computed_tokens} computed tokens")

    def _num_schedulable(self, req: Request) -> int:
        """Tokens a running request can compute now (0 when it is done but not yet updated)."""
        if (len(req.output_token_ids) + req.num_inflight_tokens >= req.sampling.max_tokens
                or req.num_known_tokens > self.max_request_len):
            return 0
        return req.num_known_tokens - req.num_computed_tokens

    def _make_chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        token_ids = req.token_ids(start, end)
        samples = end == req.num_known_tokens
        req.num_computed_tokens = end
        if samples:
            req.num_inflight_tokens += 1
        return ScheduledChunk(req, start, num_new, token_ids, num_new - len(token_ids),
                              list(req.block_ids), samples, req.num_preemptions)

    def _preempt(self, req: Request) -> None:
        if self.connector is not None:
            self.connector.on_preempt(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_token_ids:
            return "stop"
        if (len(req.output_token_ids) >= req.sampling.max_tokens
                or req.num_tokens >= self.max_request_len):
            return "length"
        return None
