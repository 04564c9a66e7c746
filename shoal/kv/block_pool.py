"""Ref-counted KV blocks, an LRU free queue and the key -> block prefix cache.

A block is in exactly one place: the free queue (ref_count == 0; it may still hold a cached
key, evicted only when it is reallocated) or in use (ref_count > 0). Freed blocks join the
queue's tail and allocation takes its head: the least recently used cached content goes
first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import takewhile


@dataclass
class Block:
    block_id: int
    ref_count: int = 0  # requests (and pins) holding this block
    key: bytes | None = None  # content key while the block is in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int):
        assert num_blocks > 0, f"num_blocks={num_blocks}"
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # key -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` from the head of the free queue; None if there are not enough."""
        if num_blocks > len(self._free):
            return None
        ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in ids:
            block = self.blocks[block_id]
            if block.key is not None:  # evict its cached content
                del self._cached[block.key]
                block.key = None
            block.ref_count = 1
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks (a prefix hit or a pin)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in this order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed with ref_count {block.ref_count}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, key: bytes) -> None:
        """Register a fully computed block under its key (first writer wins)."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"caching block {block_id} that nobody holds"
        if block.key is None and key not in self._cached:
            block.key = key
            self._cached[key] = block_id

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest cached prefix of `keys` (not touched: call touch to hold them)."""
        # to the first miss
        return list(takewhile(lambda b: b is not None, (self._cached.get(key) for key in keys)))

    def check_integrity(self) -> None:
        """Free queue, used blocks and the cache map reconcile; raises AssertionError if not."""
        num_used = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            in_free = block.block_id in self._free
            assert in_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in_free_queue={in_free}")
            num_used += block.ref_count > 0
            if block.key is not None:
                assert self._cached.get(block.key) == block.block_id, (
                    f"block {block.block_id} has a key the cache maps elsewhere")
        assert num_used + len(self._free) == self.num_blocks, (
            f"used {num_used} + free {len(self._free)} != {self.num_blocks}")
        for key, block_id in self._cached.items():
            assert self.blocks[block_id].key == key, (
                f"cache maps a key to block {block_id} without it")
