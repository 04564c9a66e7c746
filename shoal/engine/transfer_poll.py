"""The worker side of transfers, on the thread that runs the forward: before it the plan is
bound and loads start; after it saves are enqueued and the transfers pending at the step's
launch are polled, agreed over the ranks (`TransferPoller._poll`). An expired transfer is
aborted if the worker supports abort, else fatal."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from shoal.connectors.base import LoadProgress
from shoal.engine.connector_calls import ConnectorCalls
from shoal.request import Request

log = logging.getLogger(__name__)

NO_FAILURE = 1 << 62  # "no failed block" in an agreed minimum


@dataclass(frozen=True)
class TransferPlan:
    """The transfers' part of one step, fixed when the step is scheduled."""

    meta: Any = None  # the connector's plan (build_connector_meta); None without a connector
    save_epochs: dict[str, int] = field(default_factory=dict)  # saves to poll, their episodes
    loading_ids: tuple[str, ...] = ()  # loads to poll after the step
    deadlines: dict[str, float] = field(default_factory=dict)  # of those transfers

    @property
    def num_pending(self) -> int:
        return len(self.save_epochs) + len(self.loading_ids)


NO_TRANSFERS = TransferPlan()


@dataclass
class TransferReport:
    """What the workers said at the end of a step (agreed over TP ranks)."""

    finished_saving: set[str] = field(default_factory=set)
    finished_loading: set[str] = field(default_factory=set)
    failed_loads: dict[str, int] = field(default_factory=dict)  # rid -> first bad block index
    aborted: set[str] = field(default_factory=set)  # transfers aborted at their deadline
    progress: dict[str, LoadProgress] = field(default_factory=dict)  # partial loads' progress


@dataclass
class TransferOutcome:
    """What the scheduler does with a report."""

    ended: list[tuple[Request, str, str | None]] = field(default_factory=list)  # reason, error
    released: list[Request] = field(default_factory=list)  # saves done: free the blocks


class TransferPoller:
    def __init__(self, calls: ConnectorCalls):
        self.calls = calls
        self._aborted: set[str] = set()  # aborted; a plan launched before may still list them
        self._saved: dict[str, int] = {}  # rid -> save episode this rank's worker finished
        self._loaded: set[str] = set()  # loads this rank's worker finished
        self._failed: dict[str, int] = {}  # ... of which failed, from this block index on
        self._progress: dict[str, LoadProgress] = {}  # partial loads' last progress here
        self.counts = {"deadline_expiries": 0, "transfers_aborted": 0}  # for stats()

    def wait(self, timeout: float) -> None:
        """Between steps that only wait for transfers: until the worker's transfers may
        have moved, at most `timeout` seconds."""
        self.calls.work("wait_for_transfers", lambda w: w.wait_for_transfers(timeout))

    def begin_step(self, plan: TransferPlan) -> None:
        self.calls.work("bind_connector_meta", lambda w: w.bind_connector_meta(plan.meta))
        self.calls.work("start_load_kv", lambda w: w.start_load_kv())

    def end_step(self, plan: TransferPlan) -> TransferReport:
        """After the forward: saves enqueued, then a poll over the transfers pending when the
        step was launched. Expired ones are aborted or fatal."""
        self.calls.work("wait_for_save", lambda w: w.wait_for_save())
        self.calls.work("clear_connector_meta", lambda w: w.clear_connector_meta())
        report, expired = self._poll(plan)
        # the overlap loop launches a step before the last one's report is applied: a
        # transfer aborted there may still be listed as pending once
        self._aborted.intersection_update((*plan.save_epochs, *plan.loading_ids))
        expired = [rid for rid in expired if rid not in self._aborted]
        if expired:
            self.counts["deadline_expiries"] += len(expired)
            what = (f"a pending transfer passed its deadline (transfer_timeout_sec="
                    f"{self.calls.config.transfer_timeout_sec:g}, control_grace_sec="
                    f"{self.calls.config.control_grace_sec:g} after a cancel or shutdown)")
            if not self.calls.worker.supports_abort:
                self.calls.fail(what, expired[0])
            else:
                self.calls.work("abort", lambda w: w.abort(expired))
                if self.calls.failure is None:
                    log.warning("%s: aborted %s", what, expired)
                    self.counts["transfers_aborted"] += len(expired)
                    self._aborted.update(expired)
                    for rid in expired:
                        self._progress.pop(rid, None)
                    report.aborted.update(expired)
        return report

    def _poll(self, plan: TransferPlan) -> tuple[TransferReport, list[str]]:
        """This rank's poll, agreed with its peers (done where every rank is done, expired
        where any expired, failed from the first block any rank failed), and the transfers
        still pending past their deadline."""
        saves, loads = plan.save_epochs, plan.loading_ids
        ask_save = [rid for rid, epoch in saves.items() if self._saved.get(rid) != epoch]
        ask_load = [rid for rid in loads if rid not in self._loaded]
        saved, loaded = self.calls.work(
            "get_finished", lambda w: w.get_finished(ask_save, ask_load), ((), ()))
        self._saved.update((rid, saves[rid]) for rid in saved if rid in saves)
        self._loaded.update(rid for rid in loaded if rid in loads)
        self._failed.update(
            self.calls.work("get_failed_loads", lambda w: w.get_failed_loads(), {}) or {})
        partial = self.calls.partial_loads and loads
        if partial:  # a load this rank finished keeps its final progress until agreed
            self._progress.update(self.calls.work(
                "get_load_progress", lambda w: w.get_load_progress(list(loads)), {}) or {})
        mine = [self._progress.get(rid) for rid in loads] if partial else []
        pending, now = [*saves, *loads], time.monotonic()
        # free for the front where free on every rank, landed where landed on all (partial)
        flags = ([int(self._saved.get(rid) == epoch) for rid, epoch in saves.items()]
                 + [int(rid in self._loaded) for rid in loads]
                 + [self._failed.get(rid, NO_FAILURE) for rid in loads]
                 + [int(plan.deadlines.get(rid, math.inf) >= now) for rid in pending]
                 + [p.writes_from if p else 0 for p in mine]
                 + [-p.landed_from if p else -NO_FAILURE for p in mine])
        if not flags:  # the same on every rank: nothing pending, nothing to agree on
            return TransferReport(), []
        agreed = iter(self.calls.agreement.agree_min(flags))  # cut back into the groups above
        groups = (saves, loads, loads, pending, mine, mine)
        done_saves, done_loads, failed, live, writes_from, minus_landed_from = (
            list(islice(agreed, len(group))) for group in groups)
        report = TransferReport()
        for rid, p, writes, minus_landed in zip(loads, mine, writes_from, minus_landed_from):
            landed = -minus_landed
            if landed != NO_FAILURE:  # this rank's landing times where its word is the
                # agreed one (TP: a rank behind it landed later)
                times = ((p.first_landed_at, p.last_landed_at, p.started_at)
                         if p is not None and p.landed_from == landed else ())
                report.progress[rid] = LoadProgress(writes, landed, *times)
        for rid, done in zip(saves, done_saves):
            if done:
                report.finished_saving.add(rid)
                del self._saved[rid]
        for rid, done, bad in zip(loads, done_loads, failed):
            if done:
                report.finished_loading.add(rid)
                self._loaded.discard(rid)
                self._failed.pop(rid, None)
                self._progress.pop(rid, None)
                if bad != NO_FAILURE:
                    report.failed_loads[rid] = bad
        ended = report.finished_saving | report.finished_loading
        expired = [rid for rid, ok in zip(pending, live) if not ok and rid not in ended]
        return report, list(dict.fromkeys(expired))
