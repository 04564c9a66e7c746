"""Block pool: ref counts, LRU reuse of cached blocks, the prefix map, check_integrity."""

from __future__ import annotations

import pytest

from shoal.kv.block_pool import BlockPool


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1  # all or nothing
    pool.free(a)
    assert pool.num_free_blocks == 4
    pool.check_integrity()


def test_cached_blocks_are_reused_lru_and_evicted_on_reallocation():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, key in zip(ids, [b"a", b"b", b"c"]):
        pool.cache_block(i, key)
    pool.free([ids[2], ids[1], ids[0]])  # tail first: c is the least recently freed
    assert pool.lookup([b"a", b"b", b"c"]) == ids
    (reused,) = pool.allocate(1)
    assert reused == ids[2] and pool.lookup([b"a", b"b", b"c"]) == ids[:2]  # c evicted
    pool.free([reused])
    pool.check_integrity()


def test_touch_takes_a_cached_block_out_of_the_free_queue():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"k")
    pool.free([b])
    assert pool.is_free(b)
    pool.touch(pool.lookup([b"k"]))
    assert not pool.is_free(b) and pool.blocks[b].ref_count == 1
    pool.touch([b])  # a second holder
    pool.free([b])
    assert not pool.is_free(b)
    pool.free([b])
    assert pool.is_free(b)
    pool.check_integrity()


def test_first_writer_wins_for_duplicate_keys():
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    pool.cache_block(x, b"same")
    pool.cache_block(y, b"same")
    assert pool.lookup([b"same"]) == [x] and pool.blocks[y].key is None
    pool.check_integrity()


def test_lookup_stops_at_first_miss():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    pool.cache_block(ids[0], b"a")
    pool.cache_block(ids[2], b"c")
    assert pool.lookup([b"a", b"b", b"c"]) == [ids[0]]


def test_double_free_is_caught():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(AssertionError, match="ref_count 0"):
        pool.free(ids)


@pytest.mark.parametrize("corrupt", ["used_in_free_queue", "negative_ref", "dangling_key"])
def test_check_integrity_detects_corruption(corrupt):
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], b"k")
    if corrupt == "used_in_free_queue":
        pool._free[ids[1]] = None
    elif corrupt == "negative_ref":
        pool.blocks[2].ref_count = -1
    else:
        pool._cached[b"other"] = ids[1]
    with pytest.raises(AssertionError):
        pool.check_integrity()
