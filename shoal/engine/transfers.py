"""KVTransfers: the engine's one owner of KV transfers (loads, SAVING requests, save
episodes, pins, deadlines, aborts, cancels that wait for a load) and, through
ConnectorCalls, the only caller of a connector. The scheduler asks (`match`, `admit`,
`brings_in`, `plan`, `apply`, `on_preempt`, `on_finish`, `defer_cancel`); each step
carries one `TransferPlan`. Under TP, answers and polls are agreed over the ranks.

When are blocks freed? A loading request keeps them until its load is reported; a
finished request whose save is pending, until the save is reported (SAVING); a preempted
request's are pinned until its save episode ends (saves enqueued may still read them).
After a fatal failure (`failure`) the connector is asked nothing more and every block
stays held. Hook order and failure policy (SPEC 6): docs/connectors.md, "The contract"
and "Deadlines, cancellation and the failure policy".
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   RequestData, SchedulerOutput)
from shoal.engine.connector_calls import ConnectorCalls, request_view
from shoal.engine.deadlines import Deadlines
from shoal.engine.load_split import LoadDecision, LoadPlanner
from shoal.engine.peers import Agreement
from shoal.engine.pending_load import HIT_COUNTERS, LandedLoad, PendingLoad, start_turns
from shoal.engine.rates_file import rates_path, restore_rates, save_rates
from shoal.engine.transfer_poll import TransferOutcome, TransferPlan, TransferPoller, TransferReport
from shoal.kv.block_pool import BlockPool
from shoal.request import PoolHit, Request, RequestStatus

T = TypeVar("T")


class KVTransfers:
    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext,
                 registration: KVCacheRegistration, pool: BlockPool, agreement: Agreement,
                 max_num_tokens: int, on_stuck: Callable[[str], None] | None = None,
                 attention_weight: float = 0.0):
        self.config = config
        self.ctx = ctx
        self.pool = pool
        self.calls = ConnectorCalls(config, ctx, registration, agreement, on_stuck)
        self.layer_hooks = self.calls  # (wait_for_layer_load, save_kv_layer)
        self.poller = TransferPoller(self.calls)
        # the front computes while the back loads where both sides can (SPEC 3.1)
        self.partial_loads = config.compute_while_loading and self.calls.partial_loads
        self.planner = LoadPlanner(ctx.block_size, max_num_tokens, attention_weight, ctx.device)
        self._rates_path = rates_path(config, ctx)
        # rates kept between runs where loads can be split (an engine loading whole teaches too)
        if self.calls.partial_loads and self.calls.agreement.is_lead:
            restore_rates(self.planner, self._rates_path)
        self._loads: dict[str, PendingLoad] = {}  # pending loads: blocks held, never preempted
        self._landed: dict[str, LandedLoad] = {}  # loads done, the front not there yet
        self._saving: dict[str, Request] = {}  # SAVING: finished, blocks held for a save
        self._save_epochs: dict[str, int] = {}  # rid -> episode of its pending save report
        self._pins: dict[str, list[int]] = {}  # rid -> blocks pinned for its pending saves
        self._num_reported_blocks: dict[str, int] = {}  # rid -> block ids the connector knows
        self._new_loads: list[Request] = []  # admitted for a load since the last plan
        self.deadlines = Deadlines(config.transfer_timeout_sec, config.control_grace_sec)
        self.num_moves = 0  # transfers ended or advanced by applied reports (the idle wait)
        self._counts = dict.fromkeys(("connector_tokens_loaded", "load_failures_recomputed",
                                      *HIT_COUNTERS.values(), "front_tokens_computed",
                                      "pool_hit_host_tokens"), 0)  # for stats()

    # -- what the scheduler asks ----------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._loads or self._saving or self._save_epochs)

    @property
    def has_fronts(self) -> bool:
        """Some request's front is bounded by a load (pending, or landed and not reached)."""
        return bool(self._loads or self._landed)

    def match(self, req: Request, num_computed: int) -> tuple[int, int]:
        """Pool tokens beyond the local prefix hit, validated against the contract, and of
        them those the worker holds in host memory."""
        def ask(s):  # one question (under TP one collective): the match and its host part
            view = request_view(req, self.ctx)
            num, is_async = s.get_num_new_matched_tokens(view, num_computed)
            return num, is_async, max(int(s.get_num_matched_host_tokens(view)), 0) if num else 0

        num, is_async, num_host = self.calls.ask("get_num_new_matched_tokens", ask, (0, False, 0),
                                                 req.request_id)
        limit = req.num_prompt_tokens - 1 - num_computed
        if num == 0 and is_async:
            self.calls.fail("get_num_new_matched_tokens answered (0, True): an async load "
                            "of nothing", req.request_id)
        elif not 0 <= num <= max(limit, 0):
            self.calls.fail(f"get_num_new_matched_tokens offered {num} tokens; at most {limit} "
                            "are allowed (never the last prompt token)", req.request_id)
        else:
            return num, min(num_host, num)
        return 0, 0

    def admit(self, req: Request, num_cached: int, num_external: int, num_host: int = 0) -> bool:
        """Blocks were allocated for `req` (up to the end of its hit at least). True: a load
        of (part of) the hit is pending; the request's front computes only what
        `front_tokens` allows until the load has landed and the front reached it."""
        block_ids = list(req.block_ids)
        self.calls.ask("update_state_after_alloc", lambda s: s.update_state_after_alloc(
            request_view(req, self.ctx), block_ids), None, req.request_id)
        req.pool_hit = None
        if not num_external:
            return False
        bs = self.ctx.block_size
        first, end = num_cached // bs, (num_cached + num_external) // bs
        host_share = num_host / num_external
        hit = PoolHit("load", num_external, **self.planner.decision_rates(host_share),
                      num_host_tokens=num_host)
        self._counts["pool_hit_host_tokens"] += num_host
        now = time.monotonic()
        ahead = start_turns(self._loads.values(), now, bs)  # (the store's loads go in turn)
        decision = LoadDecision(first, None)  # whole loads: all of it, the front waits
        if self.partial_loads:
            decision = self._decide(lambda: self.planner.admit(first, end, host_share, ahead))
            self._drop(req, decision.load_from, first)
        load_from = decision.load_from
        hit.decision = "load" if load_from == first else "split" if load_from < end else "compute"
        req.pool_hit = hit
        self._counts[HIT_COUNTERS[hit.decision]] += 1
        if load_from >= end:  # computing it is faster: nothing is loaded
            hit.num_front_tokens = num_external
            return False
        self._loads[req.request_id] = PendingLoad(
            req, num_cached, num_external, hit, self.partial_loads, load_from, end, load_from,
            first_tokens=decision.first.num_tokens if decision.first else 0,
            host_share=host_share, admitted=now, started=None if ahead else now, behind=bool(ahead))
        self._new_loads.append(req)
        self.deadlines.start(req.request_id)
        return True

    def brings_in(self, req: Request, num_cached: int) -> bool:
        """Another request's hit in flight (loading, or landed and its front not there yet)
        brings in the block after `req`'s local prefix hit: `req` waits and hits it locally
        (requests on one pooled document load it once: docs/design.md, "Scheduling")."""
        i = num_cached // self.ctx.block_size  # (never the last token's block: no hit has it)
        return i < min(len(req.block_keys), (req.num_tokens - 1) // self.ctx.block_size) and any(
            hit.brings_in(i, req.block_keys[i], self.ctx.block_size)
            for hit in (*self._loads.values(), *self._landed.values()))

    def front_tokens(self, req: Request, limit: int) -> int | None:
        """Tokens the request's front may compute this step, at most `limit` (the step's
        room); None: no load bounds it. While the load is pending the front stays below
        the blocks it may write (those it reaches next are dropped from it a step ahead);
        once it is done, the front computes up to the landed blocks (then `take_landed`)."""
        rid, front = req.request_id, req.num_computed_tokens
        load = self._loads.get(rid)
        if load is None:
            landed = self._landed.get(rid)
            return None if landed is None else min(max(landed.start - front, 0), limit)
        if not load.is_partial or load.is_cancelled:
            return 0
        if not load.is_planned:  # admitted this step: its plan is not out yet, and the
            # admission's split holds (a drop now would unplan blocks the engine waits for)
            return self._front(load, load.first_tokens, front, limit)
        now = time.monotonic()
        ahead = start_turns(self._loads.values(), now, self.ctx.block_size, before=load)
        step = self._decide(lambda: self.planner.front_step(
            front, load.landed_from, load.end_block(self.ctx.block_size), load.started, now,
            load.host_share, busy=load.front_busy(now), ahead=ahead))
        load.dropped_to = self._drop(req, step.drop_to, load.dropped_to)
        return self._front(load, step.num_tokens, front, limit)

    def _front(self, load: PendingLoad, num_tokens: int, front: int, limit: int) -> int:
        """The front's tokens this step (PendingLoad.front_limit)."""
        n = load.front_limit(num_tokens, front, self.ctx.block_size, limit)
        if n:
            load.schedule_front(self.planner.compute_seconds(front, n))
        return n

    def front_applied(self, req: Request) -> None:
        """A step with a chunk of the request ran (the scheduler applied it)."""
        load = self._loads.get(req.request_id)
        if load is not None and load.front_in_flight:
            load.front_in_flight -= 1

    def take_landed(self, req: Request) -> int | None:
        """If the request's load is done and its front reached the landed blocks: the tokens
        with valid KV (the request goes on from there); else None."""
        landed = self._landed.get(req.request_id)
        if landed is None or req.num_computed_tokens < landed.start:
            return None
        del self._landed[req.request_id]
        self._counts["front_tokens_computed"] += landed.credit()
        return landed.num_ok

    def plan(self, chunks) -> TransferPlan:
        """The transfers of a step that computes `chunks` (ScheduledChunk list)."""
        new, cached = [], []
        computing = {c.request.request_id for c in chunks}
        for req in self._new_loads:  # admitted for a load: in the output with 0 tokens,
            self._loads[req.request_id].is_planned = True  # unless its front computes
            if req.request_id not in computing:
                new.append(self._request_data(req, (), req.num_computed_tokens, 0,
                                              req.block_ids)[0])
        self._new_loads = []
        for c in chunks:
            rd, seen = self._request_data(c.request, c.token_ids, c.start, c.num_tokens,
                                          c.block_ids)
            (cached if seen else new).append(rd)
        out = SchedulerOutput(tuple(new), tuple(cached), self.ctx.owner_rank)
        meta = self.calls.ask("build_connector_meta", lambda s: s.build_connector_meta(out), None)
        return TransferPlan(meta, dict(self._save_epochs), tuple(self._loads),
                            self.deadlines.of([*self._save_epochs, *self._loads]))

    def apply(self, plan: TransferPlan, report: TransferReport) -> TransferOutcome:
        """A step's report: finished loads run (or end), finished or aborted saves release
        their blocks, aborted loads end their requests."""
        out = TransferOutcome()
        for rid in sorted(report.aborted):  # nothing of these runs any more
            load = self._end_load(rid)
            if load is not None:
                out.ended.append(_ended(load, "the KV load did not finish within its deadline "
                                        "and was aborted"))
            req = self._end_save_episode(rid)
            if req is not None:  # its tokens stand; the save is what failed
                if req.finish_reason != "cancelled":
                    req.finish_reason = "error"
                    req.error = "the KV save did not finish within its deadline and was aborted"
                out.released.append(req)
        for rid, progress in report.progress.items():
            load = self._loads.get(rid)
            if load is not None:
                before = (load.writes_from, load.landed_from)
                load.take_progress(progress, self.ctx.block_size)
                self.num_moves += before != (load.writes_from, load.landed_from)
        for rid in sorted(report.finished_loading):
            load = self._end_load(rid)
            if load is None:
                continue  # reported by an earlier poll already (the overlap loop polls twice)
            start = load.landed_start(self.ctx.block_size)
            self.planner.observe_load(*load.measured(start))  # the load's rates
            num_ok, error, recomputed = load.outcome(start, report.failed_loads.get(rid),
                                                     self.ctx.block_size,
                                                     self.config.load_failure_policy)
            self._counts["load_failures_recomputed"] += recomputed
            if error is None:  # (a cancelled load's tokens were loaded too)
                self._counts["connector_tokens_loaded"] += num_ok - start
            if load.is_cancelled or error is not None:
                out.ended.append(_ended(load, error))
            else:
                self._landed[rid] = LandedLoad(start, num_ok, load.num_cached, load.request)
        for rid in sorted(report.finished_saving):
            epoch = plan.save_epochs.get(rid)
            if epoch is None or self._save_epochs.get(rid) != epoch:
                continue  # not asked, or about an earlier episode
            req = self._end_save_episode(rid)
            if req is not None:
                out.released.append(req)
        self.num_moves += len(out.ended) + len(out.released) + len(report.finished_loading)
        return out

    def on_preempt(self, req: Request) -> None:
        """Before the scheduler frees a preempted request's blocks (never one whose load is
        pending): saves already enqueued may still read them, so pin them until the worker
        reports the request's saves done. Landed blocks not reached yet are given up."""
        assert req.request_id not in self._loads, f"{req.request_id}: preempted while loading"
        self._landed.pop(req.request_id, None)
        if self._num_reported_blocks.pop(req.request_id, None) is not None and req.block_ids:
            self.pool.touch(req.block_ids)
            self._pins.setdefault(req.request_id, []).extend(req.block_ids)
            self._new_save_episode(req.request_id)

    def is_loading(self, request_id: str) -> bool:
        """A load of the request is pending: it may still write the request's blocks."""
        return request_id in self._loads

    def may_free(self, req: Request) -> bool:
        """False (and fatal) if a load may still write the request's blocks: ordinary
        cleanup of such a request is refused; its end comes through `apply`."""
        if self.is_loading(req.request_id):
            self.calls.fail("refused to free the blocks of a request whose load is still "
                            "pending", req.request_id)
            return False
        return True

    def on_finish(self, req: Request) -> bool:
        """A request ends (request_finished, if the connector saw it). True: a save still
        reads its blocks; they stay held here (SAVING) until the save is reported."""
        self._landed.pop(req.request_id, None)
        seen = self._num_reported_blocks.pop(req.request_id, None) is not None
        if not seen and req.request_id not in self._pins:
            return False
        block_ids = list(req.block_ids)
        if not self.calls.ask("request_finished", lambda s: s.request_finished(
                request_view(req, self.ctx), block_ids), True, req.request_id):
            return False
        self._new_save_episode(req.request_id)
        self._saving[req.request_id] = req
        return True

    def is_cancelling(self, request_id: str) -> bool:
        return getattr(self._loads.get(request_id), "is_cancelled", False)

    def defer_cancel(self, req: Request) -> bool:
        """A cancel: True if the request's load is pending (it ends once the load drains;
        what the load has not started is dropped)."""
        load = self._loads.get(req.request_id)
        if load is not None:
            load.is_cancelled = True
            if load.is_partial:
                load.dropped_to = self._drop(req, load.landed_from, load.dropped_to)
        return load is not None

    def block_refs(self) -> list[int]:
        """Every block reference held here: saving requests, pins, and loading requests out
        of the running ones (cancelled: they end once their load drains)."""
        held = [*(load.request for load in self._loads.values()
                  if load.request.status != RequestStatus.RUNNING), *self._saving.values()]
        return [b for ids in [*(req.block_ids for req in held), *self._pins.values()] for b in ids]

    def _end_deadline(self, request_id: str) -> None:
        if request_id not in self._loads and request_id not in self._save_epochs:
            self.deadlines.end(request_id)

    # -- episodes and loads ------------------------------------------------------------------

    def _new_save_episode(self, request_id: str) -> None:
        # A report counts only for the episode that was pending when its step was launched:
        # the overlap loop applies a step's poll after the next step was scheduled.
        self._save_epochs[request_id] = self._save_epochs.get(request_id, 0) + 1
        self.deadlines.start(request_id)

    def _end_save_episode(self, request_id: str) -> Request | None:
        """The request's pending save episode ends (reported, or aborted: nothing of it runs
        any more); its pins are released. Returns the request if it was SAVING (no longer);
        None if it was not, or no episode was pending."""
        if self._save_epochs.pop(request_id, None) is None:
            return None
        self.pool.free(self._pins.pop(request_id, []))
        self._end_deadline(request_id)
        return self._saving.pop(request_id, None)

    def _end_load(self, request_id: str) -> PendingLoad | None:
        load = self._loads.pop(request_id, None)
        self._end_deadline(request_id)
        return load

    def _decide(self, decide: Callable[[], T]) -> T:
        """The lead rank's decision, on every rank (TP ranks must schedule alike)."""
        agreement = self.calls.agreement
        return agreement.share(decide() if agreement.is_lead else None)

    def _drop(self, req: Request, num_blocks: int, dropped: int) -> int:
        """The blocks below `num_blocks` dropped from the request's load, where more than the
        `dropped` already; returns the new mark (every block below it is dropped)."""
        if num_blocks > dropped:
            self.calls.ask("drop_loads", lambda s: s.drop_loads(request_view(req, self.ctx),
                                                                num_blocks), None, req.request_id)
        return max(num_blocks, dropped)

    def _request_data(self, req: Request, token_ids, computed: int, num_scheduled: int,
                      block_ids: list[int]) -> tuple[RequestData, bool]:
        """The request's part of this step, and whether the connector has seen it before."""
        seen = self._num_reported_blocks.get(req.request_id)
        self._num_reported_blocks[req.request_id] = len(block_ids)
        num_full = req.num_prompt_tokens // self.ctx.block_size
        rd = RequestData(req.request_id, tuple(token_ids), tuple(block_ids[seen or 0:]), computed,
                         num_scheduled, tuple(req.block_keys[:num_full]))
        return rd, seen is not None

    # -- both (the worker side runs on the executing thread: `poller`) -----------------------

    @property
    def failure(self) -> str | None:
        """The connector's first fatal failure (the engine must stop), or None."""
        return self.calls.failure

    def stats(self) -> dict[str, float]:
        return {**self.calls.stats(), **self._counts, **self.poller.counts, **self.planner.stats()}

    def shutdown(self) -> None:
        if self.calls.partial_loads and self.calls.agreement.is_lead and self.failure is None:
            save_rates(self.planner, self._rates_path)
        self.calls.shutdown()


def _ended(load: PendingLoad, error: str | None) -> tuple[Request, str, str | None]:
    """How a load's request ends when its load ends without running it."""
    reason, error = ("cancelled", None) if load.is_cancelled else ("error", error)
    return load.request, reason, error
