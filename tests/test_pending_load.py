"""What a finished pool load leaves usable when a block of it failed (PendingLoad.outcome)."""

from __future__ import annotations

import pytest

from shoal.connectors.base import LoadProgress
from shoal.engine.pending_load import PendingLoad, start_turns
from shoal.request import PoolHit

BS = 4


def load(num_cached: int = 0, num_external: int = 40) -> PendingLoad:
    return PendingLoad(None, num_cached, num_external, PoolHit("split", num_external),
                       True, 0, 10, 0)


def test_a_failure_past_the_front_is_recomputed_from_the_failed_block():
    assert load().outcome(16, 6, BS, "recompute") == (24, None, True)
    assert load().outcome(16, 6, BS, "fail") == (0, "KV load from the pool failed at block 6",
                                                 False)


def test_no_failure_leaves_the_whole_hit():
    assert load(8, 32).outcome(16, None, BS, "recompute") == (40, None, False)


def test_a_failed_block_the_front_computed_leaves_the_rest_unknown():
    """The report names the first failed block only: one below the front (its read failed,
    then the front took it over) says nothing good of the blocks after it, which are
    recomputed from the front on (or fail the request), never taken as landed."""
    assert load().outcome(28, 6, BS, "recompute") == (28, None, True)
    error = load().outcome(28, 6, BS, "fail")[1]
    assert error == "KV load from the pool failed at block 6"


def test_a_load_is_measured_by_when_its_blocks_landed_not_by_the_polls():
    """A load that landed while a 150 ms forward ran was taken for one that took the whole
    forward (the engine polls between steps): the worker's landing times are used."""
    p = load()
    p.started = 100.0
    p.take_progress(LoadProgress(7, 9, first_landed_at=100.02, last_landed_at=100.02), BS)
    p.take_progress(LoadProgress(7, 7, first_landed_at=100.02, last_landed_at=100.05), BS)
    tokens, seconds, first, _, split = p.measured(28)
    assert tokens == 12 and seconds == pytest.approx(0.05) and first == pytest.approx(0.02)
    assert split  # (the hit was planned as a split)


def test_without_the_worker_s_times_the_polls_count():
    p = load()
    p.take_progress(LoadProgress(7, 9), BS)
    assert p.first_landed is not None and p.last_landed is None
    assert p.measured(28)[1] >= p.first_landed - p.admitted


def test_a_load_is_timed_from_its_turn():
    """The store serves an engine's loads in turn: the second load starts once the first
    has nothing left to bring in (landed or dropped), and is timed from then, not from its
    admission (its wait in the queue is not the store's latency)."""
    first, second = load(), load()
    first.admitted = second.admitted = 100.0
    loads = [first, second]
    assert start_turns(loads, 100.0, BS) == 80  # ten blocks each, none landed
    assert (first.started, second.started) == (100.0, None)
    assert start_turns(loads, 100.0, BS, before=second) == 40
    assert start_turns(loads, 100.0, BS, before=first) == 0
    first.take_progress(LoadProgress(0, 4, first_landed_at=100.01, last_landed_at=100.05), BS)
    first.dropped_to = 4  # the rest landed, the front took blocks 0-3
    assert start_turns(loads, 100.2, BS) == 40 and second.started == 100.2
    second.take_progress(LoadProgress(0, 0, first_landed_at=100.21, last_landed_at=100.4), BS)
    tokens, seconds, latency, _, _ = second.measured(0)
    assert tokens == 40 and seconds == pytest.approx(0.2) and latency == pytest.approx(0.01)


def test_the_worker_s_start_of_a_load_behind_others_times_it():
    """The worker says when it began a load (an I/O thread took its first unit): a load
    admitted behind others is timed from then, whenever the engine saw its turn; a turn the
    engine saw only after the load's first block landed (no word from the worker) says
    nothing of the store: the load is timed from its admission, as a load alone is."""
    p = load()
    p.admitted, p.behind = 100.0, True
    start_turns([p], 100.3, BS)  # (the engine's view: at a poll after a long forward)
    p.take_progress(LoadProgress(0, 9, first_landed_at=100.25, last_landed_at=100.25,
                                 started_at=100.22), BS)
    assert p.started == 100.22
    p.take_progress(LoadProgress(0, 0, first_landed_at=100.25, last_landed_at=100.32), BS)
    assert p.measured(0)[1:3] == (pytest.approx(0.1), pytest.approx(0.03))
    q = load()
    q.admitted, q.behind = 100.0, True
    start_turns([q], 100.3, BS)
    q.take_progress(LoadProgress(0, 0, first_landed_at=100.25, last_landed_at=100.25), BS)
    assert q.measured(0)[1:3] == (pytest.approx(0.25), pytest.approx(0.25))


def test_a_cancelled_load_queues_the_next_until_its_blocks_are_dropped():
    """A cancelled partial load drops what it has not landed (KVTransfers.defer_cancel): the
    next one's turn comes; one loaded whole keeps loading, and the next waits for it."""
    p = load()
    p.is_cancelled = True
    assert p.num_queued_tokens(BS) == 40
    p.dropped_to = p.landed_from
    assert p.num_queued_tokens(BS) == 0


def test_the_front_is_busy_only_while_its_chunks_are_in_flight():
    """KVTransfers counts a front chunk when it is scheduled and again when its step is
    applied: the plain loop (nothing in flight at schedule time) never waits on an estimate
    that ran long."""
    p = load()
    assert p.front_busy(0.0) == 0.0
    p.schedule_front(10.0)
    now = p.front_busy_until - 4.0
    assert p.front_busy(now) == pytest.approx(4.0)
    p.schedule_front(1.0)  # after the first one's forward
    assert p.front_busy(now) == pytest.approx(5.0)
    p.front_in_flight = 0  # both steps applied (front_applied)
    assert p.front_busy(now) == 0.0


def test_the_front_computes_what_was_dropped_from_the_load_even_when_told_to_wait():
    """Blocks dropped from the load (below dropped_to) are the front's: a planner step that
    says wait (0 tokens: the load would end the hit soon enough) still leaves them to it,
    up to the first block a copy may still write; blocks landed above are not recomputed.
    Never more than a step holds: the time booked for the front is its forward's (what a
    step leaves of the dropped blocks is the next step's)."""
    step = 1000
    p = load()  # blocks 0-9 (40 tokens), nothing dropped yet: the front waits
    assert p.front_limit(0, 0, BS, step) == 0
    p.dropped_to, p.writes_from = 4, 6  # 0-3 dropped; 4-5 landed while being dropped
    assert p.front_limit(0, 0, BS, step) == 16 and p.front_limit(0, 8, BS, step) == 8
    assert p.front_limit(20, 0, BS, step) == 20  # a larger share, up to writes_from
    assert p.front_limit(100, 0, BS, step) == 24
    assert p.front_limit(0, 0, BS, 12) == 12 and p.front_limit(0, 12, BS, 12) == 4
    p.writes_from = 2  # a copy still writes block 2: the front stops below it
    assert p.front_limit(0, 0, BS, step) == 8


def test_a_front_is_booked_for_what_its_step_has_room_for():
    """KVTransfers books a front chunk's forward time for the tokens the step can take (its
    budget, after the other requests' tokens), not for every dropped block the front must
    still compute: an overbooked front made the next steps' fronts wait."""
    import time
    from types import SimpleNamespace

    from shoal.engine.load_split import LoadPlanner
    from shoal.engine.transfers import KVTransfers

    transfers = KVTransfers.__new__(KVTransfers)  # only what `_front` reads
    transfers.ctx = SimpleNamespace(block_size=BS)
    transfers.planner = LoadPlanner(BS, 2048)
    transfers.planner.prefill_tps.value = 100.0  # tokens (units of work) a second
    p = load()
    p.dropped_to, p.writes_from = 8, 10  # 32 tokens dropped: the front's
    start = time.monotonic()
    assert transfers._front(p, 0, 0, limit=12) == 12
    booked = p.front_busy_until - start
    assert booked == pytest.approx(transfers.planner.compute_seconds(0, 12), abs=0.01)
    assert booked < transfers.planner.compute_seconds(0, 32) / 2


def test_which_blocks_a_hit_in_flight_brings_in():
    """A pending load brings in the blocks of its hit (after the local prefix), keyed as the
    request keys them; a cancelled one brings in nothing (it lands nothing for others); a
    landed one, the blocks up to where its valid KV ends (a failed block and the rest are
    the request's own to recompute)."""
    from types import SimpleNamespace

    from shoal.engine.pending_load import LandedLoad

    keys = [bytes([i]) * 8 for i in range(12)]
    req = SimpleNamespace(block_keys=keys, pool_hit=None)
    pending = PendingLoad(req, 8, 36, PoolHit("load", 36), False, 2, 11, 2)
    assert [pending.brings_in(i, keys[i], BS) for i in range(12)] == [False] * 2 + [True] * 9 + [False]
    assert not pending.brings_in(5, b"other!!!", BS)  # another prefix: other keys
    pending.is_cancelled = True
    assert not any(pending.brings_in(i, keys[i], BS) for i in range(12))
    landed = LandedLoad(start=8, num_ok=24, num_cached=8, request=req)
    assert [landed.brings_in(i, keys[i], BS) for i in range(12)] == [False] * 2 + [True] * 4 + [False] * 6
