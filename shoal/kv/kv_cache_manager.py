"""Per-request block bookkeeping on top of the block pool: prefix hits, growth, release."""

from __future__ import annotations

from shoal.kv.block_keys import extend_block_keys, request_seed
from shoal.kv.block_pool import BlockPool
from shoal.request import Request
from shoal.util import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, namespace: bytes,
                 enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching

    def update_block_keys(self, req: Request) -> None:
        """Key every full block of the request's known tokens (nothing to do, and no work,
        until a decode step completes a block)."""
        if req.num_tokens // self.block_size > len(req.block_keys):
            extend_block_keys(req.block_keys, req.token_ids(0, req.num_tokens), self.block_size,
                              request_seed(self.namespace, req.cache_salt))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks of the longest locally cached prefix. Never covers the last known token: its
        logits must be computed to sample from them."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup(req.block_keys[:max_blocks])

    def allocate(self, req: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Hold `cached_block_ids` (a prefix hit, only for a request with no blocks) and grow the
        request's blocks to cover its computed tokens (at least the hit) + num_new_tokens.
        False (and nothing changes) when there are not enough free blocks."""
        num_hit = len(cached_block_ids)
        if not num_hit and (req.num_computed_tokens + num_new_tokens
                            <= len(req.block_ids) * self.block_size):
            return True  # the common case, a decode step above all
        num_tokens = max(req.num_computed_tokens, num_hit * self.block_size)
        num_needed = max(cdiv(num_tokens + num_new_tokens, self.block_size)
                         - len(req.block_ids) - num_hit, 0)
        # cached blocks sitting in the free queue stop being free once touched
        num_reclaimed = sum(self.pool.is_free(b) for b in cached_block_ids)
        if num_needed + num_reclaimed > self.pool.num_free_blocks:
            return False
        if num_hit:
            assert not req.block_ids, f"{req.request_id}: prefix hit for a request holding blocks"
            self.pool.touch(list(cached_block_ids))
            req.block_ids = list(cached_block_ids)
            req.num_cached_blocks = num_hit
        req.block_ids.extend(self.pool.allocate(num_needed))
        return True

    def cache_computed_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed up to num_computed_tokens."""
        upto = num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or upto <= req.num_cached_blocks:
            return  # caching off, or no block completed since the last call
        self.update_block_keys(req)
        upto = min(upto, len(req.block_keys), len(req.block_ids))
        for i in range(req.num_cached_blocks, upto):
            self.pool.cache_block(req.block_ids[i], req.block_keys[i])
        req.num_cached_blocks = max(req.num_cached_blocks, upto)

    def free(self, req: Request) -> None:
        """Release the request's blocks; the tail goes to the queue first so it is evicted first."""
        self.pool.free(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_cached_blocks = 0

    def check_integrity(self) -> None:
        self.pool.check_integrity()
