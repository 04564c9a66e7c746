"""Multi-head latent attention (DeepSeek-V2/V3).

Each token keeps one compressed latent c [L] (kv_lora_rank) and one rotary key k_r [R]
per layer, shared by every head: the cache holds [L + R] per token, not K and V per head.
A head's key is (W_uk c, k_r) and its value W_uv c, with W_uk [nope, L] and W_uv [v, L]
the head's rows of `kv_b_proj`. Two ways to attend, equal in exact arithmetic:

- expanded (prefill chunks): the context's latents through `kv_b_proj` into K and V per
  head, then ordinary causal attention. Cheap when many queries share the expansion.
- absorbed (decode, and prefill chunks of at most ABSORBED_MAX_QUERY tokens: a pool hit's
  last block after a long context, where expanding every latent for a few queries cost
  more than the queries): W_uk moves onto the query, q_nope W_uk lands in the latent space,
  so the cache is attended as ONE shared head of width L + R whose values are the latents
  themselves; W_uv then maps the result out. The latent is never expanded per head. A
  short chunk's tokens attend as decode rows, each over its context up to itself.

Under TP the heads (q, kv_b and o rows/columns) are split and the latent is whole on every
rank; under ADP all of it is whole. Under the Triton backend (a CUDA device) the absorbed
decode runs the kernel of shoal/model/paged_mla.py, and a step where every row decodes
reads only the device tables (no host list), so it runs inside the decode CUDA graphs, and
so does a short chunk's (the prefill graphs up to ABSORBED_MAX_QUERY tokens); longer
prefill chunks, and decode under the torch backend, use gathers.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.model.attention_backend import (attend_per_request, causal_attention,
                                           decode_attention, gather_blocks)
from shoal.model.config import ModelConfig
from shoal.model.layers import RMSNorm
from shoal.model import paged_mla
from shoal.model.paged_mla import mla_decode
from shoal.model.rope import apply_rope, softmax_scale
from shoal.util import to_device

LORA_NORM_EPS = 1e-6  # the latent norms' epsilon (DeepSeek's configs do not set it)
# a prefill chunk of at most this many tokens attends absorbed (as that many decode rows,
# each reading the whole context) rather than expanding every latent of its context
ABSORBED_MAX_QUERY = 16


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard, backend):
        super().__init__()
        self.layer_idx = layer_idx
        self.shard = shard
        self.backend = backend
        self.num_heads = cfg.num_heads // shard.attention_size
        self.nope, self.rope, self.v = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        self.scale = softmax_scale(cfg, self.nope + self.rope)
        hidden, heads, qk = cfg.hidden_size, self.num_heads, self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent, heads * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(heads * self.v, hidden, bias=False)

    def forward(self, x, cos, sin, meta, cache, _no_values=None):
        # x [T, hidden]; cos/sin [T, R]; cache [num_blocks, block_size, 1, L + R]
        num_tokens, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self._norm(self.q_a_layernorm, self.q_a_proj(x)))
        q = q.view(num_tokens, heads, self.nope + self.rope)
        q_nope = q[..., :self.nope]
        kv_a = self.kv_a_proj_with_mqa(x)
        if self.backend.fused:  # rope, the latent's norm and the cache write: one kernel
            from shoal.model.fused_ops import mla_rope_store
            norm = self.kv_a_layernorm
            q_rot = mla_rope_store(q, kv_a, norm.weight, norm.eps, cos, sin, cache,
                                   meta.slot_block_ids, meta.slot_offsets, self.nope,
                                   self.interleaved)
        else:
            latent, k_rot = kv_a.split([self.latent, self.rope], dim=-1)
            q_rot = apply_rope(q[..., self.nope:], cos, sin, self.interleaved)
            k_rot = apply_rope(k_rot.unsqueeze(1), cos, sin, self.interleaved)  # [T, 1, R]
            entry = torch.cat((self.kv_a_layernorm(latent).unsqueeze(1), k_rot), dim=-1)
            cache[meta.slot_block_ids, meta.slot_offsets] = entry
        # an ADP padding step (no tokens: this owner has nothing, its peers do) attends nothing
        out = self._attend(q_nope, q_rot, meta, cache) if num_tokens else x.new_empty(0, heads, self.v)
        out = self.o_proj(out.reshape(num_tokens, heads * self.v))
        return self.shard.all_reduce_(out) if self.shard.shards_attention else out

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.backend.fused:
            return norm(x)
        from shoal.model.fused_ops import rms_norm
        return rms_norm(x, norm.weight, norm.eps)

    def _attend(self, q_nope, q_rot, meta, cache) -> torch.Tensor:
        """Decode rows absorbed (batched), each prefill chunk expanded -> [T, H, v]."""
        p = meta.paged
        if self.backend.paged and p.max_query_len == 1:  # the device tables alone
            return self.absorbed(q_nope, q_rot, cache, p.block_table, p.context_lens)
        if self.backend.paged and p.host is None:  # a prefill graph: one short chunk
            return self._absorbed_chunk(q_nope, q_rot, cache, p)

        def prefill(rows: slice, block_ids: torch.Tensor, ctx: int) -> torch.Tensor:
            n = rows.stop - rows.start
            if n > ABSORBED_MAX_QUERY:
                return self.expanded(q_nope[rows], q_rot[rows], cache, block_ids, ctx)
            # one decode row per token, at its own context's end; the rows' table a copy (a
            # slice of the step's table may start off the 16-byte alignment that the kernel
            # was compiled for at bring-up: a new variant in a request)
            return self.absorbed(q_nope[rows], q_rot[rows], cache,
                                 block_ids.expand(n, -1).contiguous(),
                                 list(range(ctx - n + 1, ctx + 1)))

        return attend_per_request(
            meta, q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v), cache.shape[1],
            lambda rows, table, ctxs: self.absorbed(q_nope[rows], q_rot[rows], cache, table,
                                                    ctxs), prefill)

    def _absorbed_chunk(self, q_nope, q_rot, cache, p) -> torch.Tensor:
        """A prefill graph's rows (shoal.engine.cuda_graphs: request 0's chunk of at most
        ABSORBED_MAX_QUERY tokens, then padding) from the device tables alone: token i of
        the chunk a decode row over its context up to itself, padding rows over none."""
        i = torch.arange(q_nope.shape[0], dtype=torch.int32, device=q_nope.device)
        n, ctx = p.query_lens[0], p.context_lens[0]
        lens = torch.where(i < n, ctx - n + 1 + i, 0).to(torch.int32)
        table = p.block_table[:1].expand(q_nope.shape[0], -1)
        return self.absorbed(q_nope, q_rot, cache, table, lens)

    def warm_up(self, cache: torch.Tensor, no_values: None, scratch_block: int) -> None:
        """Compile the decode kernel now (the Triton backend's bring-up; as
        Attention.warm_up, whose value cache the latent has none of)."""
        q = self.kv_b_proj.weight.new_empty(1, self.num_heads, self.latent + self.rope)
        paged_mla.warm_up(q, cache, self.latent, self.scale, scratch_block)

    def _kv_b(self) -> torch.Tensor:
        """kv_b_proj per head [H, nope + v, L]: W_uk rows first, then W_uv."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v, self.latent)

    def absorbed(self, q_nope, q_rot, cache, table, ctxs) -> torch.Tensor:
        """B decode rows, row b at the end of its context of ctxs[b] tokens (a list, or
        int32 on the device for the kernel; `table` [B, W] its blocks) -> [B, H, v],
        without expanding a latent."""
        w = self._kv_b()
        q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w[:, :self.nope])
        q = torch.cat((q_latent, q_rot), dim=-1)  # [B, H, L + R]
        if self.backend.paged:  # the kernel reads the latents through the table
            lens = ctxs if torch.is_tensor(ctxs) else to_device(ctxs, q.device, torch.int32)
            out_latent = mla_decode(q, cache, table, lens, self.latent, self.scale)
        else:
            out_latent = decode_attention(q, table, ctxs, cache, cache[..., :self.latent],
                                          self.scale)  # [B, H, L]
        return torch.einsum("bhl,hvl->bhv", out_latent, w[:, self.nope:])

    def expanded(self, q_nope, q_rot, cache, block_ids, ctx: int) -> torch.Tensor:
        """n rows, the last n of a context of `ctx` tokens in blocks `block_ids`, attend to
        it causally with K and V expanded per head -> [n, H, v]."""
        entries = gather_blocks(cache, block_ids)[0, :ctx]  # [ctx, L + R]
        latent, k_rot = entries.split([self.latent, self.rope], dim=-1)
        k_nope, values = self.kv_b_proj(latent).view(ctx, self.num_heads, self.nope + self.v).split(
            [self.nope, self.v], dim=-1)
        keys = torch.cat((k_nope, k_rot.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        return causal_attention(torch.cat((q_nope, q_rot), dim=-1), keys.transpose(0, 1),
                                values.transpose(0, 1), self.scale)

    def load(self, take, prefix: str) -> None:
        """Copy in HF weights `prefix + name`: this rank's heads of q, kv_b and o; the
        latent projections whole."""
        heads, whole = self.shard.head_rows, (lambda w: w)
        split = {"q_proj": heads, "q_b_proj": heads, "kv_b_proj": heads,
                 "o_proj": self.shard.head_cols}
        for name, param in self.named_parameters():
            module = name.split(".")[0]
            param.copy_(split.get(module, whole)(take(prefix + name)))
