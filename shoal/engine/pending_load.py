"""A pool hit's load while it is pending, and once it has landed (KVTransfers keeps them).

Block i of a request holds its tokens [i * block_size, (i + 1) * block_size). A partial
load (SPEC 3.1; docs/connectors.md, "Loads") lands its last block first while the front
computes from the start: `writes_from` bounds the front (no copy of the load writes below
it any more), `landed_from` is where the landed blocks begin.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from shoal.connectors.base import LoadProgress
from shoal.request import PoolHit, Request

# PoolHit.decision -> its stats counter
HIT_COUNTERS = {"load": "pool_hits_loaded", "split": "pool_hits_split",
                "compute": "pool_hits_computed"}


@dataclass
class PendingLoad:
    request: Request
    num_cached: int  # tokens from the local prefix cache (the load's first block is after)
    num_external: int  # tokens the pool has after them
    hit: PoolHit
    is_partial: bool  # the front computes while the back loads (3.1); else the front waits
    writes_from: int  # the load may write blocks from here on (agreed over TP ranks)
    landed_from: int  # every block from here to the end of the hit has landed
    dropped_to: int  # blocks below this index were dropped from the load (or never in it)
    admitted: float = field(default_factory=time.monotonic)  # (time.monotonic)
    # when the store began it: the store serves an engine's loads in turn (None: loads
    # admitted before it still have blocks to bring in; `start_turns`)
    started: float | None = None
    behind: bool = False  # admitted behind other loads: the worker's start, where it says
    first_tokens: int = 0  # the front's share in the admission step
    front_in_flight: int = 0  # the front's chunks scheduled, their steps not applied yet
    is_planned: bool = False  # its loads went out in a plan (drops reach the worker now)
    first_landed: float | None = None  # when a block first landed (or was first reported)
    last_landed: float | None = None  # when the latest block landed, if the worker said
    host_share: float = 0.0  # of the hit, the share expected from the worker's host memory
    is_cancelled: bool = False  # cancelled while pending: ends once the load drains
    front_busy_until: float = 0.0  # when those chunks' forwards should end

    @property
    def end_token(self) -> int:
        """The token after the hit's last."""
        return self.num_cached + self.num_external

    def end_block(self, block_size: int) -> int:
        """The block after the hit's last."""
        return self.end_token // block_size

    def front_limit(self, num_tokens: int, front: int, block_size: int, step_tokens: int) -> int:
        """`num_tokens` for the front at token `front`, but at least the blocks dropped from
        the load already (no copy writes them, whatever the planner's step says), below
        every block the load may still write, and no more than a step's `step_tokens` (the
        time booked for the front is its forward's)."""
        num_tokens = max(num_tokens, self.dropped_to * block_size - front)
        return max(min(num_tokens, self.writes_from * block_size - front, step_tokens), 0)

    def schedule_front(self, seconds: float) -> None:
        """A chunk of the front was scheduled; its forward should take `seconds`."""
        self.front_in_flight += 1
        self.front_busy_until = max(self.front_busy_until, time.monotonic()) + seconds

    def front_busy(self, now: float) -> float:
        """Seconds the front's chunks in flight should still take (the overlap loop plans a
        step while the last one runs: the front's next share computes after them)."""
        return max(self.front_busy_until - now, 0.0) if self.front_in_flight else 0.0

    def num_queued_tokens(self, block_size: int) -> int:
        """Tokens the load has still to bring in (neither landed nor dropped)."""
        return max(self.landed_from - self.dropped_to, 0) * block_size

    def measured(self, start: int) -> tuple[int, float, float | None, float, bool]:
        """The finished load as LoadPlanner.observe_load takes it (tokens from `start` on),
        timed from when the store began it (from its admission where that is not known: a
        turn the engine saw after the load's first block landed)."""
        began = self.admitted if self.started is None else self.started
        if self.first_landed is not None and self.first_landed < began:
            began = self.admitted
        first = None if self.first_landed is None else self.first_landed - began
        end = self.last_landed if self.last_landed is not None else time.monotonic()
        return (self.end_token - start, end - began, first, self.host_share,
                self.hit.decision == "split")

    def outcome(self, start: int, bad: int | None, block_size: int,
                policy: str) -> tuple[int, str | None, bool]:
        """(tokens with valid KV once the front reaches `start`, error, whether a failed
        block is recomputed). `bad`: the first failed block (None: none); it and every block
        after it are recomputed, or with policy "fail" the request ends with an error."""
        if bad is None:
            return self.end_token, None, False
        if policy == "fail":
            return self.num_cached, f"KV load from the pool failed at block {bad}", False
        # a failed block below `start` is one the front computed (under TP, landed on one
        # rank and dropped on another): the report names the first failed block only, so the
        # blocks after it are not known good either: all from `start` on are recomputed
        return min(max(bad * block_size, start), self.end_token), None, True

    def take_progress(self, progress: LoadProgress, block_size: int) -> None:
        """A poll's (agreed) word: blocks below writes_from are free for the front; blocks
        from landed_from on have landed. landed_from may lie below writes_from: units land
        out of order, and a unit that landed below one still being copied is the load's
        (not the front's to compute again) once that one lands."""
        end = self.end_block(block_size)
        self.writes_from = max(self.writes_from, min(progress.writes_from, end))
        self.landed_from = min(self.landed_from, progress.landed_from)
        if self.landed_from < end:  # the worker's times where it gave them
            if progress.first_landed_at is not None:
                self.first_landed = min(self.first_landed or math.inf, progress.first_landed_at)
            elif self.first_landed is None:
                self.first_landed = time.monotonic()
            self.last_landed = progress.last_landed_at
        if self.behind and progress.started_at is not None:  # (the worker knows best)
            self.started = progress.started_at

    def brings_in(self, i: int, key: bytes, block_size: int) -> bool:
        """Block i of the hit, keyed `key` (the same tokens up to its end), is this load's
        (a cancelled load lands nothing for others)."""
        return not self.is_cancelled and _holds(self.request, self.num_cached, self.end_token,
                                                  i, key, block_size)

    def landed_start(self, block_size: int) -> int:
        """Tokens: where the finished load's landed blocks begin (the front computed the rest)."""
        return (min(self.landed_from * block_size, self.end_token) if self.is_partial
                else self.num_cached)


def start_turns(loads: Iterable[PendingLoad], at: float, block_size: int,
                before: PendingLoad | None = None) -> int:
    """Pending loads in the order they were admitted: the first of those not started whose
    loads before it have nothing left to bring in starts at `at` (as the engine sees it;
    the worker's word replaces it). Returns the tokens the loads before `before` (all of
    them: None) still bring in."""
    ahead, ahead_of_before = 0, None
    for load in loads:
        if load is before:
            ahead_of_before = ahead
        if load.started is None and not ahead:
            load.started = max(at, load.admitted)
        ahead += load.num_queued_tokens(block_size)
    return ahead if ahead_of_before is None else ahead_of_before


@dataclass(frozen=True)
class LandedLoad:
    """A finished load whose front has not reached its landed blocks yet."""

    start: int  # tokens: where the landed blocks begin (the front computes up to here)
    num_ok: int  # tokens with valid KV once the front is there
    num_cached: int  # tokens of the local prefix hit (the front began there)
    request: Request

    def credit(self) -> int:
        """The front reached the landed blocks: the request's hit (and its connector tokens)
        says what was computed and what loaded. Returns the front's tokens."""
        hit = self.request.pool_hit
        hit.num_front_tokens = self.start - self.num_cached
        hit.num_loaded_tokens = self.request.num_connector_tokens = self.num_ok - self.start
        return hit.num_front_tokens

    def brings_in(self, i: int, key: bytes, block_size: int) -> bool:  # (as PendingLoad's)
        return _holds(self.request, self.num_cached, self.num_ok, i, key, block_size)


def _holds(request: Request, start: int, end: int, i: int, key: bytes, block_size: int) -> bool:
    """Block i of `request`, keyed `key` (the same tokens up to its end), lies in the whole
    blocks of its tokens [start, end)."""
    return start // block_size <= i < end // block_size and request.block_keys[i] == key
