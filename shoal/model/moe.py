"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts,
each a SwiGLU of its own, and their outputs are summed weighted by the router.

The router is whole on every rank; the experts are split over the shard's ranks in order
(E / size each: no rank holds them all). Each rank runs its own experts on the tokens
routed to them, and the partial outputs are summed over the ranks: under TP every rank has
every token; under ADP the owners' tokens are gathered first and each owner keeps its
rows, as for the dense MLP. The arithmetic follows transformers' (softmax in float32,
top-k, optional renormalisation, weights in the activations' dtype, experts in order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model.config import ModelConfig

# family -> (the HF module holding the router and experts, expert weight names: gate, up, down)
HF_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard):
        super().__init__()
        self.shard = shard
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_local = cfg.num_experts // shard.size
        self.first = shard.rank * self.num_local  # this rank's experts: [first, first + num_local)
        self.intermediate_size = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(self.num_local, 2 * self.intermediate_size,
                                                cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(self.num_local, cfg.hidden_size,
                                             self.intermediate_size))

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        if self.shard.gather is None:
            return self.shard.all_reduce_(self._experts(x))
        # ADP: every owner's rows, padded to the longest, through this rank's experts; the
        # sum over ranks is the whole layer, of which this owner keeps its rows
        counts = meta.dp_token_counts
        width, mine = max(counts), x.shape[0]
        every = self.shard.gather(F.pad(x, (0, 0, 0, width - mine)))
        out = self.shard.all_reduce_(self._experts(every))
        return out[self.shard.rank * width:self.shard.rank * width + mine]

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the layer's output for the rows of `x`."""
        logits = F.linear(x, self.gate.weight)
        weights, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        local = chosen - self.first  # [T, k]: an index of this rank's experts, or outside
        for e in range(self.num_local):
            rows, slots = torch.where(local == e)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down[e]) * weights[rows, slots, None]
            out.index_add_(0, rows, h.to(out.dtype))
        return out

    def load(self, take, skip, hf_prefix: str, family: str) -> None:
        """Copy in the router and this rank's experts from HF-named weights (`take(name)`
        returns one and marks it used; `skip(name)` marks another rank's as used)."""
        module, (g, u, d) = HF_MOE_NAMES[family]
        base = f"{hf_prefix}{module}."
        self.gate.weight.copy_(take(base + "gate.weight"))
        num_experts = self.gate.weight.shape[0]
        for e in range(num_experts):
            names = [f"{base}experts.{e}.{w}.weight" for w in (g, u, d)]
            if not self.first <= e < self.first + self.num_local:
                for name in names:
                    skip(name)
                continue
            gate_w, up_w, down_w = (take(n) for n in names)
            self.gate_up[e - self.first].copy_(torch.cat([gate_w, up_w]))
            self.down[e - self.first].copy_(down_w)
