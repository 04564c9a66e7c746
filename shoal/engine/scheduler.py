"""Continuous batching with chunked prefill and preemption by recompute (one owner)."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from functools import cached_property

from shoal.engine.transfer_poll import NO_TRANSFERS, TransferOutcome, TransferPlan
from shoal.engine.transfers import KVTransfers
from shoal.kv.kv_cache_manager import KVCacheManager
from shoal.util import cdiv
from shoal.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """The slice of one request computed by a step."""

    request: Request
    start: int  # first position computed (num_computed_tokens before this step)
    num_tokens: int  # positions [start, start + num_tokens) run through the model
    token_ids: list[int]  # known ids of those positions; the trailing placeholders are missing
    num_placeholders: int  # trailing positions whose ids the step in flight samples (overlap)
    # the request's block list when scheduled: a list is only ever appended to while its
    # request holds it (a release gives the request a new one), so entries [0, cdiv(start +
    # num_tokens, block_size)) stay this chunk's even after the request moves on
    block_ids: list[int]
    is_sampling: bool  # the chunk reaches the end of the known tokens: sample one token
    epoch: int  # request.num_preemptions when scheduled (a later preemption makes it stale)


@dataclass
class ScheduledBatch:
    """What one step computes."""

    chunks: list[ScheduledChunk]
    num_tokens: int  # sum of chunk.num_tokens (<= max_num_tokens)
    transfers: TransferPlan = NO_TRANSFERS  # the connector's part of the step

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @cached_property
    def sampled(self) -> list[Request]:
        """The sampling chunks' requests, in chunk order (a token each from the step)."""
        return [c.request for c in self.chunks if c.is_sampling]


class Scheduler:
    """Which requests compute what in each step. Transfers are `transfers`' business: the
    scheduler asks it at admission, when building a step, and when a request ends."""

    def __init__(self, kv: KVCacheManager, max_num_tokens: int, max_batch_size: int,
                 max_model_len: int, transfers: KVTransfers | None = None):
        self.kv = kv
        self.transfers = transfers
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        # past what the cache holds alone a request could never run: it stops there ("length")
        self.max_request_len = min(max_model_len, kv.pool.num_blocks * kv.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._deferred_free: list[Request] = []  # finished while a later step may touch blocks
        self.num_preemptions = 0
        self.num_cancellations = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running
                    or (self.transfers is not None and self.transfers.has_work))

    def add(self, req: Request) -> None:
        """Queue a request; ValueError (and nothing queued) if it can never run."""
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {req.num_prompt_tokens} tokens, more than the "
                             f"model's context of {self.max_model_len}")
        if req.num_prompt_tokens > self.max_request_len:
            need = cdiv(req.num_prompt_tokens, self.kv.block_size)
            raise ValueError(f"the prompt needs {need} KV blocks, more than the cache's "
                             f"{self.kv.pool.num_blocks}")
        self.kv.update_block_keys(req)
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_tokens
        chunks: list[ScheduledChunk] = []
        num_preemptions = self.num_preemptions  # none this step: new requests may be admitted
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._num_schedulable(req, budget)
            if num_new > 0 and self._allocate(req, num_new):
                chunks.append(self._make_chunk(req, num_new))
                budget -= num_new
            if req.status == RequestStatus.RUNNING:  # (a preempted one left the list)
                i += 1
        transfers = self.transfers
        behind: list[Request] = []  # waiting for another request's hit of their next block
        # (at most a batch of requests behind: each one skipped costs a lookup)
        while (self.waiting and budget > 0 and self.num_preemptions == num_preemptions
               and len(self.running) < self.max_batch_size and len(behind) < self.max_batch_size):
            req = self.waiting[0]
            assert req.num_inflight_tokens == 0 and not req.block_ids, req.request_id
            # prompt logprobs need every prompt position computed: no hit serves them
            computes_all = req.sampling.prompt_logprobs is not None
            hits = [] if computes_all else self.kv.find_cached_prefix(req)
            num_cached = len(hits) * self.kv.block_size
            pool = None if computes_all else transfers  # whom a pool hit is asked of
            if pool and self.kv.enable_prefix_caching and pool.brings_in(req, num_cached):
                behind.append(self.waiting.popleft())  # (its place in the queue kept)
                continue
            num_external, num_host = pool.match(req, num_cached) if pool else (0, 0)
            num_new = min(req.num_tokens - num_cached, budget)
            # the blocks of a pool hit are allocated with it (its loads' destinations)
            if not self.kv.allocate(req, max(num_new, num_external), hits):
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_local_prefix_tokens is None:
                req.num_local_prefix_tokens = num_cached
                req.metrics.scheduled_time = time.perf_counter()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if transfers and transfers.admit(req, num_cached, num_external, num_host):
                # a load is pending: the front computes what the load leaves it (SPEC 3.1)
                num_new = transfers.front_tokens(req, budget)
            if num_new > 0:
                chunks.append(self._make_chunk(req, num_new))
                budget -= num_new
        self.waiting.extendleft(reversed(behind))
        plan = transfers.plan(chunks) if transfers else NO_TRANSFERS
        return ScheduledBatch(chunks, self.max_num_tokens - budget, plan)

    def update(self, batch: ScheduledBatch, sampled: list[int], defer_free: bool,
               outcome: TransferOutcome | None = None) -> list[Request]:
        """Apply a finished step: register computed blocks, append samples (`sampled`: one
        per sampling chunk, in chunk order), finish requests, then the transfers' outcome.
        Returns the requests that ended. With defer_free the blocks of requests finishing
        now are released at the next update (a step already in flight may still write them)."""
        self.release_deferred()
        finished = []
        tokens = iter(sampled)
        fronts = self.transfers is not None and self.transfers.has_fronts
        for chunk in batch.chunks:
            req, end = chunk.request, chunk.start + chunk.num_tokens
            if chunk.epoch == req.num_preemptions and req.status is RequestStatus.RUNNING:
                if end // self.kv.block_size > req.num_cached_blocks:  # (a block was completed)
                    self.kv.cache_computed_blocks(req, end)
                if fronts:
                    self.transfers.front_applied(req)
            if not chunk.is_sampling:
                continue
            token = next(tokens)
            req.num_inflight_tokens -= 1
            if req.finish_reason is not None:
                continue  # the overlap loop ran one step past a stop token
            req.output_token_ids.append(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason, defer_free=defer_free)
                finished.append(req)
        if outcome is not None:
            finished += self._apply(outcome, defer_free)
        return finished

    def finish(self, req: Request, reason: str, error: str | None = None,
               defer_free: bool = False) -> None:
        """End a request: out of the queues, blocks released (now or at the next update) or
        held by a pending save. Refused (and fatal) while a load may write its blocks."""
        if self.transfers is not None and not self.transfers.may_free(req):
            return
        req.finish_reason, req.error = reason, error
        req.metrics.finish_time = time.perf_counter()
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if self.transfers is not None and self.transfers.on_finish(req):
            req.status = RequestStatus.SAVING  # the blocks stay held until the save is reported
            return
        self._release(req, defer_free)

    def cancel(self, req: Request, defer_free: bool) -> bool:
        """End `req` as "cancelled"; True if it ended now (possibly SAVING: its blocks stay
        pinned until the save drains). One whose load is pending computes no more, keeps its
        blocks and ends when the load drains. A transfer gets at most the grace from now."""
        transfers = self.transfers
        if req.is_finished or (transfers is not None and transfers.is_cancelling(req.request_id)):
            return False
        self.num_cancellations += 1
        ends_now = transfers is None or not transfers.defer_cancel(req)
        if ends_now:
            self.finish(req, "cancelled", defer_free=defer_free)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            req.status = RequestStatus.WAITING_FOR_LOAD
        if transfers is not None:  # the load, or the saves pending now (incl. pinned)
            transfers.deadlines.shorten(req.request_id)
        return ends_now

    def _apply(self, outcome: TransferOutcome, defer_free: bool) -> list[Request]:
        """Requests whose transfer ended them end (returned); finished saves release their
        blocks. A finished load is taken up by the request's front (`_num_schedulable`)."""
        for req, reason, error in outcome.ended:
            self.finish(req, reason, error, defer_free)
        for req in outcome.released:  # ended (and returned) before; its save is done
            self._release(req, defer_free)
        return [req for req, _, _ in outcome.ended]

    def _release(self, req: Request, defer_free: bool) -> None:
        """The request is FINISHED: its blocks are freed now, or at the next update."""
        req.status = RequestStatus.FINISHED
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
        refs = Counter(b for req in [*self.running, *self._deferred_free] for b in req.block_ids)
        if self.transfers is not None:
            refs.update(self.transfers.block_refs())
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

    def _num_schedulable(self, req: Request, budget: int) -> int:
        """Tokens a running request can compute now, at most `budget` (0 when it is done but
        not yet updated, or its front waits for a load)."""
        num_outputs = len(req.output_token_ids) + req.num_inflight_tokens
        num_known = len(req.prompt_token_ids) + num_outputs  # req.num_known_tokens, inlined
        if num_outputs >= req.sampling.max_tokens or num_known > self.max_request_len:
            return 0
        transfers = self.transfers
        if transfers is None or not transfers.has_fronts:
            return min(num_known - req.num_computed_tokens, budget)
        num_ok = transfers.take_landed(req)
        if num_ok is not None:  # the front reached the landed blocks: go on after them
            req.num_computed_tokens = num_ok
            self.kv.cache_computed_blocks(req, num_ok)
        num_new = min(num_known - req.num_computed_tokens, budget)
        front = transfers.front_tokens(req, num_new)
        return num_new if front is None else front

    def _allocate(self, req: Request, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of a running request, preempting the newest others
        while the cache is short. False: it waits for blocks, or was preempted itself."""
        while not self.kv.allocate(req, num_new):
            victim = self._preempt_newest()
            if victim is None or victim is req:  # (None: only pending loads hold blocks)
                return False
        return True

    def _preempt_newest(self) -> Request | None:
        """Preempt the newest running request that may be (a pending load still writes the
        blocks of the others): its blocks freed, it waits first in the queue. Returns it
        (None: none may be)."""
        for i in range(len(self.running) - 1, -1, -1):
            req = self.running[i]
            if self.transfers is None or not self.transfers.is_loading(req.request_id):
                del self.running[i]
                if self.transfers is not None:
                    self.transfers.on_preempt(req)
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
                self.num_preemptions += 1
                return req
        return None

    def _make_chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = req.num_computed_tokens = start + num_new
        token_ids = req.token_ids(start, end)
        is_sampling = end == req.num_known_tokens
        if is_sampling:  # (its sample, once the step runs)
            req.num_inflight_tokens += 1
        return ScheduledChunk(req, start, num_new, token_ids, num_new - len(token_ids),
                              req.block_ids, is_sampling, req.num_preemptions)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_token_ids and len(req.output_token_ids) > req.sampling.min_tokens:
            return "stop"
        if (len(req.output_token_ids) >= req.sampling.max_tokens
                or req.num_tokens >= self.max_request_len):
            return "length"
        return None
