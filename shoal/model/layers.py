"""The dense building blocks every family shares: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the variance in float32 whatever the dtype (as transformers computes it)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU of `intermediate_size` columns, split by columns over the shard's ranks
    (gate/up column-parallel, down row-parallel): the ranks' outputs sum to the whole."""

    def __init__(self, hidden_size: int, intermediate_size: int, shard, backend):
        super().__init__()
        self.shard = shard
        self.backend = backend
        self.intermediate_size = intermediate_size // shard.size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, x, meta):
        return self.shard.every_token(x, meta, self.partial)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns' share of the output for the rows of `x`."""
        gate_up = self.gate_up_proj(x)
        if self.backend.fused:  # one kernel
            from shoal.model.fused_ops import silu_mul
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def load(self, take, prefix: str, names=("gate_proj", "up_proj", "down_proj")) -> None:
        """Copy in this rank's columns of HF weights `prefix + name + ".weight"`."""
        g, u, d = (take(f"{prefix}{n}.weight") for n in names)
        rows, cols = self.shard.rows, self.shard.cols
        self.gate_up_proj.weight.copy_(torch.cat([rows(g), rows(u)]))
        self.down_proj.weight.copy_(cols(d))
