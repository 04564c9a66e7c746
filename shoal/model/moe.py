"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, DeepSeek-V2/V3): a router picks each token's
top-k experts, each a SwiGLU of its own, and their outputs are summed weighted by the
router; DeepSeek adds shared experts that every token goes through.

The router is whole on every rank; the routed experts are split over the shard's ranks in
order (E / size each: no rank holds them all), the shared experts by columns. Each rank
runs its experts on the tokens routed to them (`Shard.every_token`: under ADP the owners'
tokens are gathered first, as for the dense MLP), and the partial outputs are summed over
the ranks. The arithmetic follows transformers' (scores in float32, the top k, optional
renormalisation and scaling, weights in the activations' dtype, experts in order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model.config import DEEPSEEK, ModelConfig
from shoal.model.fused_moe import TILES, fused_experts
from shoal.model.layers import MLP

# family -> (the HF module holding the router and experts, expert weight names: gate, up, down)
HF_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shard, backend):
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.backend = backend
        self.num_local = cfg.num_experts // shard.size
        self.first = shard.rank * self.num_local  # this rank's experts: [first, first + num_local)
        self.intermediate_size = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # DeepSeek-V3: added to the scores to choose the experts, not to weigh them
        self.score_bias = (nn.Parameter(torch.zeros(cfg.num_experts))
                           if cfg.topk_method == "noaux_tc" else None)
        self.gate_up = nn.Parameter(torch.empty(self.num_local, 2 * self.intermediate_size,
                                                cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(self.num_local, cfg.hidden_size,
                                             self.intermediate_size))
        self.shared = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts,
                           shard, backend) if cfg.num_shared_experts else None)

    @property
    def float32_router(self) -> bool:
        """DeepSeek's router weighs in float32 whatever the model's dtype (as transformers)."""
        return self.cfg.family in DEEPSEEK

    def router_to_float32(self) -> None:
        """After the model was cast: the router's weight and expert bias back in float32
        where the family keeps them so."""
        if self.float32_router:
            self.gate.float()
            if self.score_bias is not None:
                self.score_bias.data = self.score_bias.data.float()

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        return self.shard.every_token(x, meta, self.partial)

    def warm_up(self) -> None:
        """Compile the router's and the fused experts' kernels, at every tile size, now (a
        GPU engine's bring-up) rather than in the first forward that routes few rows to
        each expert: an engine without decode graphs met the small tiles in its first
        short prefill (1.8 s with a cold Triton cache)."""
        x = self.gate_up.new_zeros(1, self.cfg.hidden_size)
        weights, chosen = self.route(x)
        for tiles in TILES.values():
            fused_experts(x, self.gate_up, self.down, weights, chosen, self.first, tiles)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, experts [T, k])."""
        cfg = self.cfg
        if self.float32_router:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = F.linear(x, self.gate.weight)
        if cfg.topk_method == "greedy" and self.backend is not None and self.backend.fused:
            from shoal.model.fused_moe import route_softmax_topk  # one launch
            return route_softmax_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor, x.dtype)
        if cfg.topk_method == "noaux_tc":
            scores = logits.float().sigmoid()
            choice = scores + self.score_bias.float()
        else:
            scores = choice = torch.softmax(logits.float(), dim=-1)
        if cfg.topk_method != "greedy":  # only the experts of the best groups may be chosen
            groups = choice.view(x.shape[0], cfg.num_expert_groups, -1)
            group_score = (groups.max(dim=-1).values if cfg.topk_method == "group_limited_greedy"
                           else groups.topk(2, dim=-1).values.sum(dim=-1))
            best = group_score.topk(cfg.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(groups.shape[-1], dim=1),
                                        float("-inf"))
        chosen = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * cfg.routed_scaling_factor).to(x.dtype), chosen

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the layer's output for the rows of `x`."""
        weights, chosen = self.route(x)
        if self.backend.paged:  # the Triton backend: two grouped-GEMM launches
            out = fused_experts(x, self.gate_up, self.down, weights, chosen, self.first)
        else:
            out = self.experts_one_by_one(x, weights, chosen)
        if self.shared is not None:
            out = out + self.shared.partial(x)
        return out

    def experts_one_by_one(self, x, weights, chosen) -> torch.Tensor:
        """The routed experts' share, an expert at a time (the fused kernel's reference)."""
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

    def load(self, take, skip, hf_prefix: str) -> None:
        """Copy in the router and this rank's experts from HF-named weights (`take(name)`
        returns one and marks it used; `skip(name)` marks another rank's as used)."""
        module, (g, u, d) = HF_MOE_NAMES[self.cfg.family]
        base = f"{hf_prefix}{module}."
        self.gate.weight.copy_(take(base + "gate.weight"))
        if self.score_bias is not None:
            self.score_bias.copy_(take(base + "gate.e_score_correction_bias"))
        for e in range(self.cfg.num_experts):
            names = [f"{base}experts.{e}.{w}.weight" for w in (g, u, d)]
            if not self.first <= e < self.first + self.num_local:
                for name in names:
                    skip(name)
                continue
            gate_w, up_w, down_w = (take(n) for n in names)
            self.gate_up[e - self.first].copy_(torch.cat([gate_w, up_w]))
            self.down[e - self.first].copy_(down_w)
        if self.shared is not None:
            self.shared.load(take, base + "shared_experts.")
