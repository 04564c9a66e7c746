"""The paged KV cache: one tensor per engine, block-major (docs/design.md, "KV cache").

Layout `[num_blocks, num_layers, parts, block_size, num_kv_heads, head_dim]`: one block's
K and V of every layer are one contiguous run, moved to or from a pool in one copy. Parts:
K and V, or one for latent attention (MLA: one head of latent + rotary key)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KV_LAYOUT_VERSION = 1  # bump when the layout changes: it is hashed into block keys


@dataclass(frozen=True)
class KVCacheLayout:
    """What a connector needs to know to move blocks in and out of the cache."""

    num_blocks: int
    num_layers: int
    block_size: int  # token slots per block
    num_kv_heads: int  # heads held by this rank
    head_dim: int
    dtype: torch.dtype
    parts: int = 2  # K and V; 1: MLA's latent (its value is part of it)
    layout_version: int = KV_LAYOUT_VERSION

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: [num_layers, parts, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, self.parts, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize


class KVCache:
    """Owns the KV tensor and hands the model per-layer views."""

    def __init__(self, layout: KVCacheLayout, device: torch.device):
        self.layout = layout
        # Zero-filled: padded attention reads unused slots with weight 0, and 0 * NaN from
        # uninitialised memory would poison the output. One block more than the layout's:
        # the scratch block, where padded rows of a CUDA-graph batch write (no request owns it).
        storage = torch.zeros((layout.num_blocks + 1, *layout.block_shape), dtype=layout.dtype,
                              device=device)
        self.tensor = storage[:layout.num_blocks]  # what the block pool and connectors see
        self.scratch_block = layout.num_blocks
        # layer i -> (k, v) views [num_blocks + 1, block_size, heads, head_dim]; MLA: (latent, None)
        self.layers = [(storage[:, i, 0], storage[:, i, 1] if layout.parts == 2 else None)
                       for i in range(layout.num_layers)]
