"""This rank's slice of a model split over several ranks (TP or attention DP).

TP: heads, MLP columns and experts are split; every rank sees the same tokens. ADP:
attention is whole on every rank (each owner attends over its own requests); the MLP
columns and the experts are split, and each such layer gathers every owner's tokens before
it and hands each owner its rows after (`every_token`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    reduce: object = None  # callable summing a tensor in place over the shard's ranks
    gather: object = None  # ADP: callable all-gathering equal-sized tensors (None in TP)

    @property
    def shards_attention(self) -> bool:
        return self.gather is None

    @property
    def attention_size(self) -> int:
        return self.size if self.shards_attention else 1

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.size == 1 else self.reduce(t)

    def rows(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's share of a weight's output features (a column-parallel layer)."""
        step = w.shape[0] // self.size
        return w[self.rank * step:(self.rank + 1) * step]

    def cols(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's share of a weight's input features (a row-parallel layer)."""
        step = w.shape[1] // self.size
        return w[:, self.rank * step:(self.rank + 1) * step]

    def head_rows(self, w: torch.Tensor) -> torch.Tensor:
        """`rows` of an attention weight: its heads under TP, all of it under ADP."""
        return self.rows(w) if self.shards_attention else w

    def head_cols(self, w: torch.Tensor) -> torch.Tensor:
        return self.cols(w) if self.shards_attention else w

    def every_token(self, x: torch.Tensor, meta,
                    partial: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A layer whose ranks' `partial` outputs sum to the whole (split MLP columns, split
        experts), over this rank's rows `x` [T, hidden]. Under TP every rank has every
        token. Under ADP every owner's rows are gathered, padded to the longest
        (`meta.dp_token_counts`), through this rank's part; the sum over ranks is the
        layer's output, of which this owner keeps its rows."""
        if self.gather is None:
            return self.all_reduce_(partial(x))
        width, mine = max(meta.dp_token_counts), x.shape[0]
        every = self.gather(F.pad(x, (0, 0, 0, width - mine)))  # [num_owners * width, hidden]
        out = self.all_reduce_(partial(every))
        return out[self.rank * width:self.rank * width + mine]
