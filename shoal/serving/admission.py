"""How many generation requests the server takes at once (`--max-concurrent-requests`) and
how many may wait for a place (`--max-queue`); past both, a 429 with Retry-After.

A place is taken before a request is tokenized and held until every one of its choices
has ended in the engine (a cancelled choice ends at the engine's next step), so the places
bound the engine's work and the server's memory, not just open connections. Waiters get
places in arrival order; one whose client leaves gives its turn up. Everything here runs
on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque

from shoal.serving.errors import ApiError

MAX_RETRY_AFTER_S = 600


class QueueFull(ApiError):
    """429: every place is taken and the queue is full. `retry_after_s`: a whole number of
    seconds after which a place is likely (Retry-After)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(429, message, type_="rate_limit_error", code="too_many_requests")
        self.retry_after_s = retry_after_s


class Place:
    """One admitted request's place; `release` (idempotent) gives it to the next waiter."""

    def __init__(self, admission: "Admission"):
        self._admission = admission
        self._taken_at = time.monotonic()
        self.is_released = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self._admission._release(time.monotonic() - self._taken_at)


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int):
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.num_running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._hold_s = 1.0  # moving mean of how long a place is held (for Retry-After)
        self._idle = asyncio.Event()  # no place held, nobody waiting
        self._idle.set()

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def take_now(self) -> Place | None:
        """A place if one is free and nobody waits; None if the request must wait;
        QueueFull if the queue is full too."""
        if self.num_running < self.max_concurrent and not self.num_waiting:
            return self._take()
        if self.num_waiting >= self.max_queue:
            raise QueueFull(
                f"the server is at its limit ({self.max_concurrent} requests running, "
                f"{self.max_queue} waiting); retry later", self.retry_after_s())
        return None

    async def wait(self) -> Place:
        """A place once one frees up (at once if one did since `take_now`). Cancelling
        the wait (the client left) leaves the queue, or hands on a place given meanwhile."""
        if self.num_running < self.max_concurrent and not self.num_waiting:
            return self._take()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # a place came with the cancel
                Place(self).release()
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it
                    self._waiters.remove(waiter)
            raise
        return Place(self)  # the releaser's place, handed on (num_running unchanged)

    async def wait_idle(self) -> None:
        """Returns once no place is held and nobody waits."""
        await self._idle.wait()

    def fail_waiters(self, error: BaseException) -> None:
        """Every request waiting for a place gets `error` instead (the server stops)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    def _take(self) -> Place:
        self.num_running += 1
        self._idle.clear()
        return Place(self)

    def retry_after_s(self) -> int:
        waves = (self.num_waiting + 1) / self.max_concurrent
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(waves * self._hold_s)))

    def _release(self, held_s: float) -> None:
        self._hold_s += 0.2 * (held_s - self._hold_s)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_running -= 1
        if not self.num_running:
            self._idle.set()
