"""ConnectorManager: the engine's only caller of a connector, and its bookkeeping.

Per step, in both executor loops (scheduler side on the scheduling thread, worker side on
the thread that runs the forward):

    scheduler side   get_num_new_matched_tokens / update_state_after_alloc (admissions)
                     build_connector_meta (every step, also when empty)
                     request_finished (once per request that reached the connector)
    worker side      bind_connector_meta -> start_load_kv
                     -> [per layer: wait_for_layer_load(i), layer i, save_kv_layer(i)]
                     -> wait_for_save -> clear_connector_meta
                     -> get_finished(saving_ids, loading_ids) -> get_failed_loads

Blocks a transfer may touch stay held: a loading request keeps its blocks (it is in no
batch and never preempted); a finished request whose save is pending keeps them until
the worker reports it; a preempted request's blocks are pinned (an extra reference) until
the request's final save report, because saves already enqueued may still read them.

Failure policy (SPEC 6): every pending transfer has a deadline, set when it is first
pending and never extended (a cancel or shutdown shortens it to the grace). An exception
from any hook, a contract violation or an expired deadline (unless the worker supports
abort) is fatal: the manager records `failure`, asks the connector nothing more, keeps
every block held, and the engine stops with that message (a fleet votes it to every rank).
An abort-capable worker's expired transfer is aborted and becomes its request's error.
A hook call that does not return within transfer_timeout_sec is fatal too: the watchdog
(shoal.connectors.watchdog) records it and tells `on_stuck`, since the thread that would
raise is the one stuck in the hook.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shoal.kv.block_pool import BlockPool
from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   RequestData, RequestView, SchedulerOutput)
from shoal.connectors.registry import resolve_connector
from shoal.connectors.watchdog import HookWatchdog
from shoal.request import Request

log = logging.getLogger(__name__)

# What a scheduler-side hook yields once the connector has failed (it is not asked again):
# nothing matched, an empty plan, and a finished request keeps its blocks
SAFE_ANSWERS = {"get_num_new_matched_tokens": (0, False), "update_state_after_alloc": None,
                "build_connector_meta": None, "request_finished": True}

# Memory a copy may still touch after a fatal failure: kept referenced for the life of the
# process, never freed or reused (a restart is required anyway)
KEEP_ALIVE: list = []


@dataclass
class TransferReport:
    """What the worker side said at the end of a step (produced on the executing thread)."""

    finished_saving: set[str] = field(default_factory=set)
    finished_loading: set[str] = field(default_factory=set)
    failed_loads: dict[str, int] = field(default_factory=dict)  # rid -> first bad block index
    aborted: set[str] = field(default_factory=set)  # transfers aborted at their deadline


class ConnectorManager:
    """`lead`: this process runs the connector's scheduler side (under TP only rank 0 does;
    see shoal.parallel.agreement)."""

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext, registration:
                 KVCacheRegistration, pool: BlockPool, lead: bool = True):
        scheduler_cls, worker_cls = resolve_connector(config)
        if ctx.num_owners > 1:
            for cls in (scheduler_cls, worker_cls):
                if not getattr(cls, "supports_attention_dp", False):
                    raise ValueError(f"connector class {cls.__module__}.{cls.__qualname__} does "
                                     "not declare supports_attention_dp = True")
        self.config = config
        self.ctx = ctx
        self.pool = pool
        self.scheduler = scheduler_cls(config, ctx) if lead else None
        self.worker = worker_cls(config, ctx)
        self.worker.register_kv_caches(registration)
        self._num_reported_blocks: dict[str, int] = {}  # rid -> block ids the connector knows
        self._load_plans: dict[str, tuple[int, int]] = {}  # rid -> (num_cached, num_external)
        self._pins: dict[str, list[int]] = {}  # rid -> blocks pinned for its pending saves
        self._save_epochs: dict[str, int] = {}  # rid -> episode of its pending save report
        self._pending_new: list[Request] = []  # admitted for a load this step (0 tokens)
        self._deadlines: dict[str, float] = {}  # rid -> deadline of its pending transfers
        self.failure: str | None = None  # the first fatal failure: the engine must stop
        self._aborted: set[str] = set()  # aborted; the scheduler may not know yet (overlap)
        self.layer_hooks = _LayerHooks(self)  # what the forward calls per layer
        # told (from the watchdog's thread) when a hook call blocks: the engine's owner
        # fails what waits on the stuck engine (LLM: its handles; a rank: the process)
        self.on_stuck: Callable[[str], None] | None = None
        self._watchdog = HookWatchdog(config.transfer_timeout_sec, self._hook_stuck)
        self.num_connector_tokens_loaded = 0
        self.num_load_failures_recomputed = 0
        self.num_deadline_expiries = 0
        self.num_aborted = 0

    # -- scheduler side ------------------------------------------------------------------

    def fail(self, what: str, request_id: str | None = None) -> None:
        """Record a fatal failure (the first one counts); the engine stops at its next check."""
        if self.failure is not None:
            return
        about = f", request {request_id}" if request_id else ""
        self.failure = (f"KV connector failure (owner {self.ctx.owner_rank}, rank {self.ctx.rank}"
                        f"{about}): {what}. The engine must be restarted.")
        log.error("%s", self.failure)

    def _ask(self, hook: str, *args):
        """Call a scheduler-side hook (TP: on rank 0, the answer broadcast to every rank)."""
        if self.failure is not None:
            return SAFE_ANSWERS[hook]
        token = self._watchdog.enter(hook)
        try:
            return getattr(self.scheduler, hook)(*args)
        except Exception as e:
            rid = args[0].request_id if args and isinstance(args[0], RequestView) else None
            self.fail(f"{hook} raised {type(e).__name__}: {e}", rid)
            return SAFE_ANSWERS[hook]
        finally:
            self._watchdog.leave(token)

    def _hook_stuck(self, hook: str) -> None:
        self.fail(f"{hook} did not return within transfer_timeout_sec="
                  f"{self.config.transfer_timeout_sec:g} (a connector hook must not block)")
        if self.on_stuck is not None:
            self.on_stuck(self.failure)

    def view(self, req: Request) -> RequestView:
        num_full = req.num_prompt_tokens // self.ctx.block_size
        return RequestView(req.request_id, tuple(req.prompt_token_ids), req.cache_salt,
                           tuple(req.block_keys[:num_full]), self.ctx.owner_rank)

    def match(self, req: Request, num_computed: int) -> tuple[int, bool]:
        """Pool tokens beyond the local prefix hit, validated against the contract."""
        num, is_async = self._ask("get_num_new_matched_tokens", self.view(req), num_computed)
        limit = req.num_prompt_tokens - 1 - num_computed
        if num == 0 and is_async:
            self.fail("get_num_new_matched_tokens answered (0, True): an async load of nothing",
                      req.request_id)
        elif not 0 <= num <= max(limit, 0):
            self.fail(f"get_num_new_matched_tokens offered {num} tokens; at most {limit} are "
                      "allowed (never the last prompt token)", req.request_id)
        else:
            return num, is_async
        return 0, False

    def after_alloc(self, req: Request, num_cached: int, num_external: int) -> None:
        self._ask("update_state_after_alloc", self.view(req), list(req.block_ids))
        if num_external:
            self._load_plans[req.request_id] = (num_cached, num_external)
            self._pending_new.append(req)
            self._start_deadline(req.request_id)

    def build_meta(self, chunks) -> Any:
        """The connector's plan for a step that computes `chunks` (ScheduledChunk list)."""
        new, cached = [], []
        for req in self._pending_new:  # admitted for a load: in the output with 0 tokens
            new.append(self._request_data(req, (), req.num_computed_tokens, 0, req.block_ids)[0])
        self._pending_new = []
        for c in chunks:
            rd, seen = self._request_data(c.request, c.token_ids, c.start, c.num_tokens,
                                          c.block_ids)
            (cached if seen else new).append(rd)
        out = SchedulerOutput(tuple(new), tuple(cached), self.ctx.owner_rank)
        return self._ask("build_connector_meta", out)

    def _request_data(self, req: Request, token_ids, computed: int, num_scheduled: int,
                      block_ids: list[int]) -> tuple[RequestData, bool]:
        """The request's part of this step, and whether the connector has seen it before."""
        seen = self._num_reported_blocks.get(req.request_id)
        self._num_reported_blocks[req.request_id] = len(block_ids)
        num_full = req.num_prompt_tokens // self.ctx.block_size
        rd = RequestData(req.request_id, tuple(token_ids), tuple(block_ids[seen or 0:]), computed,
                         num_scheduled, tuple(req.block_keys[:num_full]))
        return rd, seen is not None

    def on_preempt(self, req: Request) -> None:
        """Before the scheduler frees a preempted request's blocks: saves already enqueued may
        still read them, so pin them until the worker reports the request's saves done."""
        if self._num_reported_blocks.pop(req.request_id, None) is not None and req.block_ids:
            self.pool.touch(req.block_ids)
            self._pins.setdefault(req.request_id, []).extend(req.block_ids)
            self._new_save_episode(req.request_id)

    def on_finish(self, req: Request) -> bool:
        """request_finished for requests the connector saw. True = keep the blocks until the
        worker reports the save finished."""
        seen = self._num_reported_blocks.pop(req.request_id, None) is not None
        self._load_plans.pop(req.request_id, None)
        if not seen and req.request_id not in self._pins:
            return False
        if self._ask("request_finished", self.view(req), list(req.block_ids)):
            self._new_save_episode(req.request_id)
            return True
        return False

    def _new_save_episode(self, request_id: str) -> None:
        # A report counts only for the episode that was pending when its step was launched:
        # the overlap loop applies a step's poll after the next step was scheduled.
        self._save_epochs[request_id] = self._save_epochs.get(request_id, 0) + 1
        self._start_deadline(request_id)

    # -- deadlines ---------------------------------------------------------------------------

    def _start_deadline(self, request_id: str) -> None:
        """A transfer of the request is pending from now (an earlier deadline stands)."""
        self._deadlines.setdefault(request_id,
                                   time.monotonic() + self.config.transfer_timeout_sec)

    def _end_deadline(self, request_id: str) -> None:
        if request_id not in self._load_plans and request_id not in self._save_epochs:
            self._deadlines.pop(request_id, None)

    def shorten_deadline(self, request_id: str) -> None:
        """A cancel or shutdown: the request's pending transfers get at most the grace."""
        if request_id in self._deadlines:
            self._deadlines[request_id] = min(self._deadlines[request_id],
                                              time.monotonic() + self.config.control_grace_sec)

    def shorten_all_deadlines(self) -> None:
        for rid in list(self._deadlines):
            self.shorten_deadline(rid)

    def deadlines(self, request_ids) -> dict[str, float]:
        """A snapshot for a step (read on the executing thread)."""
        return {rid: self._deadlines.get(rid, math.inf) for rid in request_ids}

    def is_loading(self, request_id: str) -> bool:
        """A load of the request is pending: it may still write the request's blocks."""
        return request_id in self._load_plans

    @property
    def has_pending_saves(self) -> bool:
        return bool(self._save_epochs)

    def pending_saves(self) -> dict[str, int]:
        """Request id -> save episode, for every request whose saves must be reported."""
        return dict(self._save_epochs)

    def save_reported(self, request_id: str, epoch: int) -> bool:
        """A finished-saving report for `epoch`; True if it ends the pending episode (its pins
        are released; the caller releases a finished request's own blocks)."""
        if self._save_epochs.get(request_id) != epoch:
            return False
        return self.save_aborted(request_id)

    def save_aborted(self, request_id: str) -> bool:
        """The request's pending save episode ends (reported, or aborted by the worker:
        nothing of it runs any more); its pins are released. False if none was pending."""
        if self._save_epochs.pop(request_id, None) is None:
            return False
        self.pool.free(self._pins.pop(request_id, []))
        self._end_deadline(request_id)
        return True

    def load_aborted(self, request_id: str) -> None:
        self._load_plans.pop(request_id, None)
        self._end_deadline(request_id)

    def pinned_block_refs(self) -> list[int]:
        return [b for blocks in self._pins.values() for b in blocks]

    def load_result(self, req: Request, report: TransferReport) -> tuple[int, str | None]:
        """(tokens with valid KV after the load, error) for a request whose load finished.
        A failed block and everything after it is recomputed (or, with policy "fail", the
        request ends with an error)."""
        num_cached, num_external = self._load_plans.pop(req.request_id)
        self._end_deadline(req.request_id)
        bad = report.failed_loads.get(req.request_id)
        if bad is None:
            num_ok = num_cached + num_external
        elif self.config.load_failure_policy == "fail":
            return num_cached, f"KV load from the pool failed at block {bad}"
        else:
            self.num_load_failures_recomputed += 1
            num_ok = min(max(bad * self.ctx.block_size, num_cached), num_cached + num_external)
        self.num_connector_tokens_loaded += num_ok - num_cached
        return num_ok, None

    # -- worker side (the executing thread) ------------------------------------------------

    def _work(self, hook: str, *args):
        """Call a worker hook; an exception is fatal, and a failed connector is not called."""
        if self.failure is not None:
            return None
        token = self._watchdog.enter(f"worker {hook}")
        try:
            return getattr(self.worker, hook)(*args)
        except Exception as e:
            self.fail(f"worker {hook} raised {type(e).__name__}: {e}")
            return None
        finally:
            self._watchdog.leave(token)

    def begin_step(self, meta: Any) -> None:
        self._work("bind_connector_meta", meta)
        self._work("start_load_kv")

    def end_step(self, save_epochs: dict[str, int], loading_ids: list[str],
                 deadlines: dict[str, float]) -> TransferReport:
        """After the forward: saves enqueued, then a poll over the pending transfers
        (`save_epochs`: the pending saves and their episodes when the step was launched;
        `deadlines`: their deadlines then). Expired ones are aborted or fatal."""
        self._work("wait_for_save")
        self._work("clear_connector_meta")
        report, expired = self._poll(save_epochs, loading_ids, deadlines)
        # the overlap loop launches a step before the last one's report is applied: a
        # transfer aborted there may still be listed as pending once
        self._aborted.intersection_update((*save_epochs, *loading_ids))
        expired = [rid for rid in expired if rid not in self._aborted]
        if expired:
            self.num_deadline_expiries += len(expired)
            what = (f"a pending transfer passed its deadline (transfer_timeout_sec="
                    f"{self.config.transfer_timeout_sec:g}, control_grace_sec="
                    f"{self.config.control_grace_sec:g} after a cancel or shutdown)")
            if not self.worker.supports_abort:
                self.fail(what, expired[0])
            else:
                self._work("abort", expired)
                if self.failure is None:
                    log.warning("%s: aborted %s", what, expired)
                    self.num_aborted += len(expired)
                    self._aborted.update(expired)
                    report.aborted.update(expired)
        return report

    def _poll(self, save_epochs: dict[str, int], loading_ids: list[str],
              deadlines: dict[str, float]) -> tuple[TransferReport, list[str]]:
        """This rank's poll, and the still-pending transfers past their deadline."""
        answer = self._work("get_finished", list(save_epochs), list(loading_ids))
        saved, loaded = answer if answer is not None else ((), ())
        report = TransferReport(set(saved), set(loaded), dict(self._work("get_failed_loads") or {}))
        now = time.monotonic()
        expired = [rid for rid in (*save_epochs, *loading_ids)
                   if rid not in report.finished_saving and rid not in report.finished_loading
                   and deadlines.get(rid, math.inf) < now]
        return report, list(dict.fromkeys(expired))

    # -- both --------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        s = {**(self.scheduler.stats() if self.scheduler else {}), **self.worker.stats()}
        s["connector_tokens_loaded"] = self.num_connector_tokens_loaded
        s["load_failures_recomputed"] = self.num_load_failures_recomputed
        s["deadline_expiries"] = self.num_deadline_expiries
        s["transfers_aborted"] = self.num_aborted
        return s

    def shutdown(self) -> None:
        self._watchdog.stop()
        if self.failure is not None:
            # a copy may still be running: keep the connector and its memory, wait for nothing
            KEEP_ALIVE.append(self)
            return
        self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


class _LayerHooks:
    """The per-layer worker hooks, as the forward calls them (exceptions are fatal)."""

    def __init__(self, manager: ConnectorManager):
        self._manager = manager

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self._manager._work("wait_for_layer_load", layer_idx)

    def save_kv_layer(self, layer_idx: int) -> None:
        self._manager._work("save_kv_layer", layer_idx)
