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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.block_pool import BlockPool
from shoal.connectors.base import (ConnectorConfig, ConnectorContext, KVCacheRegistration,
                                   RequestData, RequestView, SchedulerOutput)
from shoal.connectors.registry import resolve_connector
from shoal.request import Request


@dataclass
class TransferReport:
    """What the worker side said at the end of a step (produced on the executing thread)."""

    finished_saving: set[str] = field(default_factory=set)
    finished_loading: set[str] = field(default_factory=set)
    failed_loads: dict[str, int] = field(default_factory=dict)  # rid -> first bad block index


class ConnectorManager:
    """`lead`: this process runs the connector's scheduler side (under TP only rank 0 does;
    see shoal.parallel.tp_connector)."""

    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext, registration:
                 KVCacheRegistration, pool: BlockPool, lead: bool = True):
        scheduler_cls, worker_cls = resolve_connector(config)
        if ctx.mode == "adp":
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
        self.num_connector_tokens_loaded = 0
        self.num_load_failures_recomputed = 0

    # -- scheduler side ------------------------------------------------------------------

    def _ask(self, hook: str, *args):
        """Call a scheduler-side hook (TP: on rank 0, the answer broadcast to every rank)."""
        return getattr(self.scheduler, hook)(*args)

    def view(self, req: Request) -> RequestView:
        num_full = req.num_prompt_tokens // self.ctx.block_size
        return RequestView(req.request_id, tuple(req.prompt_token_ids), req.cache_salt,
                           tuple(req.block_keys[:num_full]), self.ctx.owner_rank)

    def match(self, req: Request, num_computed: int) -> tuple[int, bool]:
        """Pool tokens beyond the local prefix hit, validated against the contract."""
        num, is_async = self._ask("get_num_new_matched_tokens", self.view(req), num_computed)
        if num == 0 and is_async:
            raise RuntimeError(f"connector answered (0, True) for {req.request_id}: "
                               "an async load of nothing")
        limit = req.num_prompt_tokens - 1 - num_computed
        if not 0 <= num <= max(limit, 0):
            raise RuntimeError(f"connector offered {num} tokens for {req.request_id}; "
                               f"at most {limit} are allowed (never the last prompt token)")
        return num, is_async

    def after_alloc(self, req: Request, num_cached: int, num_external: int) -> None:
        self._ask("update_state_after_alloc", self.view(req), list(req.block_ids))
        if num_external:
            self._load_plans[req.request_id] = (num_cached, num_external)
            self._pending_new.append(req)

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
        del self._save_epochs[request_id]
        self.pool.free(self._pins.pop(request_id, []))
        return True

    def pinned_block_refs(self) -> list[int]:
        return [b for blocks in self._pins.values() for b in blocks]

    def load_result(self, req: Request, report: TransferReport) -> tuple[int, str | None]:
        """(tokens with valid KV after the load, error) for a request whose load finished.
        A failed block and everything after it is recomputed (or, with policy "fail", the
        request ends with an error)."""
        num_cached, num_external = self._load_plans.pop(req.request_id)
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

    def begin_step(self, meta: Any) -> None:
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv()

    def end_step(self, save_epochs: dict[str, int], loading_ids: list[str]) -> TransferReport:
        """After the forward: saves enqueued, then a poll over the pending transfers
        (`save_epochs`: the pending saves and their episodes when the step was launched)."""
        self.worker.wait_for_save()
        self.worker.clear_connector_meta()
        saved, loaded = self.worker.get_finished(list(save_epochs), loading_ids)
        failed = self.worker.get_failed_loads()
        return TransferReport(set(saved), set(loaded), dict(failed))

    # -- both --------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        s = {**(self.scheduler.stats() if self.scheduler else {}), **self.worker.stats()}
        s["connector_tokens_loaded"] = self.num_connector_tokens_loaded
        s["load_failures_recomputed"] = self.num_load_failures_recomputed
        return s

    def shutdown(self) -> None:
        self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
