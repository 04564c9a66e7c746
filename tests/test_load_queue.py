"""A load's queue of units: what a drop takes, per block and per unit (no timing: threads
meet at events)."""

from __future__ import annotations

import threading
import time

from shoal.connectors.base import LoadProgress
from shoal.connectors.store.load_queue import LoadQueue
from shoal.connectors.store.scheduler import BlockTransfer


def units(*groups):
    """Units of block indices (each unit last block first, as the worker reads them)."""
    return [[BlockTransfer("r", i, 100 + i, b"k%d" % i) for i in group] for group in groups]


def test_a_drop_takes_unclaimed_blocks_of_a_running_unit():
    q = LoadQueue(units([9, 8, 7, 6], [5, 4, 3, 2]), per_block=True)
    back = q.pop()
    assert q.claim(back[0]) and q.claim(back[1])  # 9 is being read, 8 too
    q.land(back[0])
    reading = threading.Event()
    dropped = threading.Event()

    def drop():
        reading.set()
        q.drop(9)  # waits for block 8's read, takes 7 and 6 and the queued unit
        dropped.set()

    thread = threading.Thread(target=drop)
    thread.start()
    assert reading.wait(10)
    assert not dropped.is_set()  # it cannot return while block 8 is being read
    q.land(back[1])  # block 8's read ends: the drop returns
    thread.join(10)
    assert dropped.is_set()
    assert not q.claim(back[2]) and not q.wants(back[3])  # 7 and 6 are no longer the load's
    assert q.pop() is None
    q.done(back)
    assert q.progress() == LoadProgress(writes_from=8, landed_from=8)  # 8 and 9 landed


def test_without_per_block_a_running_unit_is_the_workers():
    q = LoadQueue(units([9, 8, 7, 6], [5, 4, 3, 2]))
    back = q.pop()
    q.drop(10)  # only the queued unit goes
    assert q.wants(back[2]) and q.pop() is None
    assert q.progress() == LoadProgress(writes_from=6, landed_from=10)
    q.done(back)
    assert q.progress() == LoadProgress(writes_from=6, landed_from=6)


def test_a_drop_past_the_load_takes_all_of_it():
    q = LoadQueue(units([9, 8], [7, 6]), per_block=True)
    back = q.pop()
    q.drop(50)
    assert q.pop() is None and not q.wants(back[0])
    assert q.progress() == LoadProgress(writes_from=10, landed_from=10)


def test_blocks_land_one_by_one():
    q = LoadQueue(units([9, 8, 7, 6]), per_block=True)
    back = q.pop()
    for t in back[:2]:
        assert q.claim(t)
        q.land(t)
    assert q.progress() == LoadProgress(writes_from=6, landed_from=8)


def test_a_read_waiting_for_its_turn_gives_up_when_dropped():
    q = LoadQueue(units([9, 8]), per_block=True)
    back = q.pop()
    given_up = []
    thread = threading.Thread(target=lambda: given_up.append(q.wait_turn(back[1], time.monotonic() + 600)))
    thread.start()
    q.drop(9)  # block 8's turn would never come: the drop ends the wait
    thread.join(10)
    assert given_up == [False]
    assert q.wait_turn(back[0], 0.0)  # block 9's turn has come (its time is past)


def test_a_failed_block_of_a_unit_copied_whole_is_the_load_s_even_below_a_drop():
    """A drop cannot stop a unit being copied: its blocks land, the failed one with them,
    and the engine takes every block from landed_from on as loaded, so that one is
    reported; a failed block below landed_from was dropped (the front computes it)."""
    q = LoadQueue(units([9, 8], [7, 6], [5, 4]))  # a GPU's mover: units copied whole
    q.done(q.pop())
    running = q.pop()
    q.drop(8)  # takes [5, 4] only
    q.done(running)
    assert q.progress() == LoadProgress(writes_from=6, landed_from=6)
    assert q.first_bad([7]) == 7 and q.first_bad([]) is None
    per_block = LoadQueue(units([9, 8], [7, 6]), per_block=True)
    back = per_block.pop()
    failed = per_block.pop()[1]  # block 6: its read failed, it landed (nothing usable)
    assert per_block.claim(failed)
    per_block.land(failed)
    per_block.drop(8)  # takes the unclaimed block 7
    for t in back:
        assert per_block.claim(t)
        per_block.land(t)
    assert per_block.progress().landed_from == 8 and per_block.first_bad([6]) is None


def test_progress_says_when_blocks_landed():
    """The first block's landing time stays; the latest moves on (the engine measures a
    load by them, not by its polls, which a forward running meanwhile delays); the start
    is when an I/O task first took a unit (a load waiting behind others starts late)."""
    q = LoadQueue(units([9, 8], [7, 6]))
    assert q.progress().first_landed_at is None and q.progress().last_landed_at is None
    assert q.progress().started_at is None
    before = time.monotonic()
    unit = q.pop()
    started = q.progress().started_at
    assert before <= started <= time.monotonic()
    q.done(unit)
    first = q.progress()
    assert started <= first.first_landed_at == first.last_landed_at <= time.monotonic()
    q.done(q.pop())
    last = q.progress()
    assert last.first_landed_at == first.first_landed_at and last.started_at == started
    assert first.last_landed_at <= last.last_landed_at <= time.monotonic()
    assert last == LoadProgress(writes_from=6, landed_from=6)  # (times aside)
