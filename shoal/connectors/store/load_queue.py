"""One request's partial load as a queue of units, and a pace for reads (store workers)."""

from __future__ import annotations

import threading
import time
from collections import deque

from shoal.connectors.base import LoadProgress
from shoal.connectors.store.scheduler import BlockTransfer


class LoadQueue:
    """One request's load as units (lists of blocks), taken by I/O tasks in order (last
    blocks first), and what has become of each of its blocks. Thread-safe."""

    QUEUED, RUNNING, LANDED = 1, 2, 3

    def __init__(self, units: list[list[BlockTransfer]]):
        self._units = deque(units)
        self.num_units = len(units)
        indices = [t.block_index for unit in units for t in unit]
        self.first, self.end = min(indices), max(indices) + 1
        self._state = [0] * (self.end - self.first)  # per block from `first`: 0 = not loaded
        for i in indices:
            self._state[i - self.first] = self.QUEUED
        self._lock = threading.Lock()
        self.is_aborted = False  # the units running skip the blocks they have not read

    def abort(self) -> None:
        self.drop(self.end)
        self.is_aborted = True

    def pop(self) -> list[BlockTransfer] | None:
        with self._lock:
            if not self._units:
                return None
            unit = self._units.popleft()
            self._mark(unit, self.RUNNING)
            return unit

    def done(self, unit: list[BlockTransfer]) -> None:
        with self._lock:
            self._mark(unit, self.LANDED)

    def drop(self, num_blocks: int) -> None:
        """Take the queued units that lie wholly below block `num_blocks` off the queue."""
        with self._lock:
            keep = deque()
            for unit in self._units:
                if max(t.block_index for t in unit) < num_blocks:
                    self._mark(unit, 0)
                else:
                    keep.append(unit)
            self._units = keep

    def progress(self) -> LoadProgress:
        with self._lock:
            state = self._state
            landed = len(state)
            while landed > 0 and state[landed - 1] == self.LANDED:
                landed -= 1
            pending = next((i for i, s in enumerate(state)
                            if s in (self.QUEUED, self.RUNNING)), None)
            writes_from = landed if pending is None else pending
            return LoadProgress(self.first + writes_from, self.first + landed)

    def _mark(self, unit: list[BlockTransfer], state: int) -> None:
        for t in unit:
            self._state[t.block_index - self.first] = state


class Throttle:
    """Paces reads to a rate shared by every thread: each read waits for its turn."""

    def __init__(self, gbps: float):
        self._bytes_per_s = gbps * 1e9
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self._bytes_per_s
        if start > now:
            time.sleep(start - now)
