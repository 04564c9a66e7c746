"""One request's partial load as a queue of units, and a pace for reads (store workers)."""

from __future__ import annotations

import threading
import time
from collections import deque

from shoal.connectors.base import LoadProgress
from shoal.connectors.store.scheduler import BlockTransfer


class LoadQueue:
    """One request's load as units (lists of blocks), taken by I/O tasks in order (last
    blocks first), and what has become of each of its blocks. Thread-safe.

    With `per_block` (a worker that reads each block straight into its place: no copy it
    cannot stop), a task claims each block before reading it and lands it right after, so
    the engine sees blocks land one by one, and a drop also takes the blocks of running
    units that no read has claimed yet (it waits for the reads under way: one block each).
    Without it, a running unit's blocks are the worker's until the whole unit is done."""

    QUEUED, RUNNING, READING, LANDED = 1, 2, 3, 4

    def __init__(self, units: list[list[BlockTransfer]], per_block: bool = False,
                 after=None):
        self._units = deque(units)
        self.num_units = len(units)
        self.per_block = per_block
        indices = [t.block_index for unit in units for t in unit]
        self.first, self.end = min(indices), max(indices) + 1
        self._state = [0] * (self.end - self.first)  # per block from `first`: 0 = not loaded
        for i in indices:
            self._state[i - self.first] = self.QUEUED
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a read ended, or a drop
        self.is_aborted = False  # the units running skip the blocks they have not read
        self.after = after  # what the load's copies wait for (on a GPU: PagedMover.fence)
        self._landed_at: tuple[float, float] | None = None  # (first, latest) block landing
        self._started_at: float | None = None  # an I/O task first took a unit

    def abort(self) -> None:
        self.drop(self.end)
        self.is_aborted = True

    def pop(self) -> list[BlockTransfer] | None:
        with self._lock:
            if not self._units:
                return None
            unit = self._units.popleft()
            self._mark(unit, self.RUNNING)
            if self._started_at is None:
                self._started_at = time.monotonic()
            return unit

    def wants(self, t: BlockTransfer) -> bool:
        """Whether block `t` of a running unit is still to be read (not dropped)."""
        with self._lock:
            return self._state[t.block_index - self.first] == self.RUNNING

    def wait_turn(self, t: BlockTransfer, until: float) -> bool:
        """Wait until `until` (time.monotonic) for block `t`'s turn to be read; False as soon
        as it is dropped (a read paced by a slow store gives up its wait at once)."""
        with self._lock:
            i = t.block_index - self.first
            while self._state[i] == self.RUNNING:
                left = until - time.monotonic()
                if left <= 0:
                    return True
                self._changed.wait(left)
            return False

    def claim(self, t: BlockTransfer) -> bool:
        """Per block: take block `t` for a read into its place (False: it was dropped). Until
        `land(t)`, a drop below it waits for it."""
        with self._lock:
            i = t.block_index - self.first
            if self._state[i] != self.RUNNING:
                return False
            self._state[i] = self.READING
            return True

    def land(self, t: BlockTransfer) -> None:
        """Per block: the read of block `t` has ended (its bytes landed, or it failed)."""
        with self._lock:
            self._state[t.block_index - self.first] = self.LANDED
            self._stamp()
            self._changed.notify_all()

    def done(self, unit: list[BlockTransfer]) -> None:
        """The unit's copies have ended: its blocks not dropped have landed."""
        with self._lock:
            landed = False
            for t in unit:
                i = t.block_index - self.first
                if self._state[i] != 0:
                    landed = landed or self._state[i] != self.LANDED
                    self._state[i] = self.LANDED
            if landed:  # (per block, each landed as it was read)
                self._stamp()

    def drop(self, num_blocks: int) -> None:
        """Take the blocks below `num_blocks` off the load: the queued units wholly below it,
        and (per block) the unclaimed blocks of running units; returns once no read below
        it is under way."""
        with self._lock:
            keep = deque()
            for unit in self._units:
                if max(t.block_index for t in unit) < num_blocks:
                    self._mark(unit, 0)
                else:
                    keep.append(unit)
            self._units = keep
            if not self.per_block:
                return
            below = range(min(max(num_blocks - self.first, 0), len(self._state)))
            for i in below:
                if self._state[i] == self.RUNNING:
                    self._state[i] = 0
            self._changed.notify_all()  # reads waiting for their turn on dropped blocks
            while any(self._state[i] == self.READING for i in below):
                self._changed.wait()

    def progress(self) -> LoadProgress:
        with self._lock:
            state = self._state
            landed = len(state)
            while landed > 0 and state[landed - 1] == self.LANDED:
                landed -= 1
            pending = next((i for i, s in enumerate(state)
                            if s in (self.QUEUED, self.RUNNING, self.READING)), None)
            writes_from = landed if pending is None else pending
            return LoadProgress(self.first + writes_from, self.first + landed,
                                *(self._landed_at or (None, None)), self._started_at)

    def first_bad(self, failed) -> int | None:
        """Of the blocks whose reads failed, the first one the finished load counts as
        landed (from `progress().landed_from` on: a unit copied whole lands every block of
        it, a dropped one too); one below that was dropped, the front's to compute."""
        landed_from = self.progress().landed_from
        return min((i for i in failed if i >= landed_from), default=None)

    def _stamp(self) -> None:
        now = time.monotonic()
        self._landed_at = (self._landed_at[0] if self._landed_at else now, now)

    def _mark(self, unit: list[BlockTransfer], state: int) -> None:
        for t in unit:
            self._state[t.block_index - self.first] = state


class Throttle:
    """Paces reads to a rate shared by every thread, as a store that slow would deliver
    them: each read takes the next slot of nbytes / rate, and its bytes arrive when the
    slot ends."""

    def __init__(self, gbps: float):
        self._bytes_per_s = gbps * 1e9
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """When (time.monotonic) the bytes of a read of `nbytes` arrive."""
        with self._lock:
            self._next = max(time.monotonic(), self._next) + nbytes / self._bytes_per_s
            return self._next

    def wait(self, nbytes: int) -> None:
        delay = self.reserve(nbytes) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
