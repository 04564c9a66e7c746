"""The executor loop: schedule -> execute -> update, plain or overlapped.

Plain: each step runs its batch and applies the results before the next schedule.
Overlap: step N+1 is scheduled and launched on the worker thread while step N's forward
runs; N's results are applied after N+1 is launched. Tokens a step needs but the
scheduler has not seen yet are placeholders the runner fills from the previous step.
Both loops run the same `_execute`, so outputs are identical.

With a connector, `_execute` also runs the worker-side hooks around the forward and
polls for finished transfers; a step with nothing to compute still runs them while
transfers are pending (no forward pass then).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from shoal.engine.transfers import ConnectorManager, TransferReport
from shoal.engine.model_runner import ModelRunner
from shoal.request import Request
from shoal.engine.scheduler import ScheduledBatch, Scheduler

IDLE_POLL_SECONDS = 0.0005  # pause of a step that only waits for transfers


@dataclass
class StepOutput:
    """What executing one batch produced (on the executing thread)."""

    sampled: list[int]  # one token per sampling chunk, in chunk order
    transfers: TransferReport | None  # the connector's poll at the end of the step


@dataclass
class StepResult:
    finished: list[Request]  # requests that ended in this step
    num_scheduled_tokens: int  # tokens of the batch launched in this step (0 = idle)


class Executor:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool,
                 connector: ConnectorManager | None = None, fleet_sync=None):
        self.scheduler = scheduler
        # ADP: fleet_sync(num_tokens, has_work, num_pending_transfers, failure) -> every
        # owner's num_tokens (the step's one control all-gather; it raises on every owner if
        # any owner's connector failed); all join a forward if any has tokens
        self.fleet_sync = fleet_sync
        self.runner = runner
        self.overlap = overlap
        self.connector = connector
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="shoal-forward") if overlap else None
        self._inflight: tuple[ScheduledBatch, Future] | None = None
        self._forget_ids: list[str] = []  # runner state to drop once no step can need it
        self.num_iterations = 0
        self.num_forward_passes = 0
        self.forward_seconds = 0.0  # wall time of forwards (incl. sampling), executing thread

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def cancel(self, req: Request) -> bool:
        """End `req` as cancelled; True if it ended now (else once its pending load drains)."""
        return self.scheduler.cancel(req, defer_free=self._inflight is not None)

    def step(self) -> StepResult:
        self.num_iterations += 1
        batch = self.scheduler.schedule()
        if self.fleet_sync is not None:
            failure = None if self.connector is None else self.connector.failure
            batch.dp_token_counts = self.fleet_sync(
                batch.num_tokens, self.has_work, len(batch.saving_ids) + len(batch.loading_ids),
                failure)
        # a step runs if it computes, polls transfers or pads for an ADP peer; else it idles
        runs = not batch.is_empty or batch.has_transfers or batch.is_padding
        if self.overlap:
            finished = self._overlap_step(batch if runs else None)
        else:
            finished = self._update(batch, self._execute(batch, []), defer_free=False) if runs else []
        if batch.is_empty and batch.has_transfers:
            time.sleep(IDLE_POLL_SECONDS)  # only waiting for the connector: do not spin
        return StepResult(finished, batch.num_tokens)

    def _overlap_step(self, batch: ScheduledBatch | None) -> list[Request]:
        # Runner state of requests that ended before the step in flight was launched: that step
        # may still read it, the one launched now runs after it.
        launched = None
        if batch is not None:
            forget, self._forget_ids = self._forget_ids, []
            launched = self._worker.submit(self._execute, batch, forget)
        finished: list[Request] = []
        if self._inflight is not None:
            prev_batch, prev_future = self._inflight
            finished = self._update(prev_batch, prev_future.result(), defer_free=launched is not None)
        self._inflight = None if launched is None else (batch, launched)
        if launched is None:
            self.scheduler.release_deferred()
        return finished

    def _execute(self, batch: ScheduledBatch, forget_ids: list[str]) -> StepOutput:
        """One step's work on the executing thread: connector hooks around the forward."""
        for request_id in forget_ids:
            self.runner.forget(request_id)
        connector = self.connector
        if connector is not None:  # this owner's own plan (empty in a padding step)
            connector.begin_step(batch.connector_meta)
        sampled = []
        if not batch.is_empty or batch.is_padding:
            self.num_forward_passes += 1
            start = time.perf_counter()
            # padding rows never reach a connector: no layer hooks for a padding forward
            hooks = connector.layer_hooks if connector is not None and not batch.is_empty else None
            sampled = self.runner.execute(batch, hooks)
            self.forward_seconds += time.perf_counter() - start
        report = None
        if connector is not None:
            report = connector.end_step(batch.save_epochs, batch.loading_ids, batch.deadlines)
        return StepOutput(sampled, report)

    def _update(self, batch: ScheduledBatch, out: StepOutput, defer_free: bool) -> list[Request]:
        finished = self.scheduler.update(batch, out.sampled, defer_free)
        if out.transfers is not None:
            finished += self.scheduler.apply_transfers(batch, out.transfers, defer_free)
        if defer_free:  # a step is in flight: forget with the next launch
            self._forget_ids.extend(r.request_id for r in finished)
        else:
            for request_id in [*self._forget_ids, *(r.request_id for r in finished)]:
                self.runner.forget(request_id)
            self._forget_ids = []
        return finished

    def shutdown(self, wait: bool = True) -> None:
        """Finish the step in flight, then stop the forward thread; `wait=False` (after a
        fatal connector failure) waits for neither: the step may be stuck in a hook."""
        while wait and self._inflight is not None:
            self._overlap_step(None)
        if self._worker is not None:
            self._worker.shutdown(wait=wait)
