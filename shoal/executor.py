"""The executor loop: schedule -> execute -> update, plain or overlapped.

Plain: each step runs its batch and applies the results before the next schedule.
Overlap: step N+1 is scheduled and launched on the worker thread while step N's forward
runs; N's results are applied after N+1 is launched. Tokens a step needs but the
scheduler has not seen yet are placeholders the runner fills from the previous step.
Both loops run the same runner code, so outputs are identical.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from shoal.model_runner import ModelRunner
from shoal.request import Request
from shoal.scheduler import ScheduledBatch, Scheduler


@dataclass
class StepResult:
    finished: list[Request]  # requests that ended in this step
    num_scheduled_tokens: int  # tokens of the batch launched in this step (0 = idle)


class Executor:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.overlap = overlap
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="shoal-forward") if overlap else None
        self._inflight: tuple[ScheduledBatch, Future] | None = None
        self._finished_ids: list[str] = []  # runner state to drop once no step can need it
        self.num_iterations = 0
        self.num_forward_passes = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    def step(self) -> StepResult:
        self.num_iterations += 1
        batch = self.scheduler.schedule()
        if self.overlap:
            finished = self._overlap_step(batch)
        elif batch.is_empty:
            finished = []
        else:
            self.num_forward_passes += 1
            finished = self.scheduler.update(batch, self.runner.execute(batch), defer_free=False)
            self._forget(finished)
        return StepResult(finished, batch.num_tokens)

    def _overlap_step(self, batch: ScheduledBatch) -> list[Request]:
        launched = None
        if not batch.is_empty:
            self.num_forward_passes += 1
            forget, self._finished_ids = self._finished_ids, []
            launched = self._worker.submit(self._run, batch, forget)
        finished: list[Request] = []
        if self._inflight is not None:
            prev_batch, prev_future = self._inflight
            finished = self.scheduler.update(prev_batch, prev_future.result(),
                                             defer_free=launched is not None)
        self._inflight = None if launched is None else (batch, launched)
        if launched is None:
            self.scheduler.release_deferred()
            self._forget([r for r in finished])
        else:
            self._finished_ids.extend(r.request_id for r in finished)
        return finished

    def _run(self, batch: ScheduledBatch, forget: list[str]) -> list[int]:
        for request_id in forget:
            self.runner.forget(request_id)
        return self.runner.execute(batch)

    def _forget(self, finished: list[Request]) -> None:
        for req in finished:
            self.runner.forget(req.request_id)
        for request_id in self._finished_ids:
            self.runner.forget(request_id)
        self._finished_ids = []

    def shutdown(self) -> None:
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
