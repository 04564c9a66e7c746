"""Llama-family decoder over a flat token batch with paged attention.

The forward takes the tokens of every scheduled request concatenated into one
`[num_tokens]` vector. Projections and the MLP run on all tokens at once; attention
reads and writes the paged KV cache through `AttentionMetadata` (built by the model
runner). Arithmetic follows `transformers`' Llama op for op so that greedy outputs
match it token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model.attention_backend import TorchBackend
from shoal.model.config import ModelConfig
from shoal.model.moe import SparseMoE


@dataclass
class PagedInputs:
    """One step's requests as attention reads them (every backend): per request with
    tokens this step, its rows in the batch and its blocks."""

    block_table: torch.Tensor  # [S, W] int32, each row padded with block 0
    query_starts: torch.Tensor  # [S] int32: first row of the request's tokens in the batch
    query_lens: torch.Tensor  # [S] int32: its tokens this step
    context_lens: torch.Tensor  # [S] int32: tokens with KV after this step (0: padding)
    max_query_len: int  # 1: every request decodes one token, rows in request order
    # the three above as host lists (starts, lens, context lens), for a backend that loops
    # over requests on the host (the torch backend); None in a CUDA graph's inputs
    host: tuple[list[int], list[int], list[int]] | None = None


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and what each request attends to."""

    slot_block_ids: torch.Tensor  # [T] block holding each token's KV slot
    slot_offsets: torch.Tensor  # [T] offset of that slot inside its block
    paged: PagedInputs
    dp_token_counts: list[int] | None = None  # ADP: every owner's tokens in this forward


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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with llama3 scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a tensor-parallel model.

    TP: heads and MLP are split, every rank sees the same tokens. ADP: attention is whole
    on every rank (each owner attends over its own requests), the MLP is split, and each
    layer gathers every owner's tokens before it and hands each owner its rows after."""

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


class Attention(nn.Module):
    """Heads are split over the shard's ranks: qkv column-parallel (its bias too), o_proj
    row-parallel. The q/k norms (Qwen3) weigh one head_dim, shared by every head: whole.
    The cache is read and written by the model's attention backend."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard, backend):
        super().__init__()
        self.layer_idx = layer_idx
        self.shard = shard
        self.backend = backend
        self.num_heads = cfg.num_heads // shard.attention_size
        self.num_kv_heads = cfg.num_kv_heads // shard.attention_size
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        # x [T, hidden]; cos/sin [T, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = self.backend.fused and self.q_norm is None
        if fused:  # q and k rotated in place by one kernel
            from shoal.model.fused_ops import rope_
            rope_(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = (t.view(num_tokens, n, self.head_dim) for t, n in zip(
            qkv.split(self.split, dim=-1), (self.num_heads, self.num_kv_heads, self.num_kv_heads)))
        if not fused:
            if self.q_norm is not None:  # per head, before RoPE (as transformers' Qwen3)
                q, k = self.q_norm(q), self.k_norm(k)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        self.backend.store(k, v, k_cache, v_cache, meta)
        # an ADP padding step (no tokens: this owner has nothing, its peers do) attends nothing
        out = self.backend.attend(q, meta, k_cache, v_cache) if num_tokens else q
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return self.shard.all_reduce_(out) if self.shard.shards_attention else out


class MLP(nn.Module):
    """SwiGLU; gate/up column-parallel, down row-parallel over the shard's ranks."""

    def __init__(self, cfg: ModelConfig, shard: Shard, backend):
        super().__init__()
        self.shard = shard
        self.backend = backend
        self.intermediate_size = cfg.intermediate_size // shard.size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, meta: AttentionMetadata):
        fused = self.backend.fused
        if self.shard.gather is None:
            return self.shard.all_reduce_(self._mlp(x, fused))
        # ADP: rows of every owner, padded to the longest, through this rank's MLP columns;
        # the sum over ranks is the full MLP output, of which this owner keeps its rows.
        counts = meta.dp_token_counts
        width, mine = max(counts), x.shape[0]
        padded = F.pad(x, (0, 0, 0, width - mine))  # [width, hidden]
        every = self.shard.gather(padded)  # [num_owners * width, hidden]
        out = self.shard.all_reduce_(self._mlp(every, fused))
        return out[self.shard.rank * width:self.shard.rank * width + mine]

    def _mlp(self, x, fused: bool):
        gate_up = self.gate_up_proj(x)
        if fused:  # one kernel
            from shoal.model.fused_ops import silu_mul
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard, backend):
        super().__init__()
        self.backend = backend
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, shard, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SparseMoE(cfg, shard) if layer_idx in cfg.moe_layers
                    else MLP(cfg, shard, backend))

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        if not self.backend.fused:  # the reference ops
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
            return x + self.mlp(self.post_attention_layernorm(x), meta)
        from shoal.model.fused_ops import add_rms_norm, rms_norm  # fused kernels
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h = self.self_attn(rms_norm(x, norm1.weight, norm1.eps), cos, sin, meta, k_cache, v_cache)
        h, x = add_rms_norm(h, x, norm2.weight, norm2.eps)
        return x + self.mlp(h, meta)


def _whole(w: torch.Tensor) -> torch.Tensor:
    return w


def check_shardable(cfg: ModelConfig, size: int, field: str = "tp_size") -> None:
    """ValueError unless `size` divides every dimension the split touches (ADP, named by
    field="dp_size", splits only the MLP: the dense one by columns, the experts by expert)."""
    dims = []
    if len(cfg.moe_layers) < cfg.num_layers:  # some layer has the dense MLP
        dims.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers:
        dims.append(("num_experts", cfg.num_experts))
    if field == "tp_size":
        dims = [("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads), *dims]
    for name, n in dims:
        if n % size:
            raise ValueError(f"{field}={size} must divide the model's {name} ({n})")


class LlamaModel(nn.Module):
    """Decoder stack + LM head. Parameter names follow HF with q/k/v and gate/up merged."""

    def __init__(self, cfg: ModelConfig, shard: Shard = Shard(), backend=None):
        super().__init__()
        check_shardable(cfg, shard.size, "tp_size" if shard.shards_attention else "dp_size")
        self.cfg = cfg
        self.shard = shard
        self.backend = backend or TorchBackend()  # one for every layer (attention_backend)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, self.backend)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights_if_needed()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def use_backend(self, backend) -> None:
        """Read and write the cache through `backend` from now on (every layer)."""
        for module in self.modules():
            if "backend" in module.__dict__:
                module.backend = backend

    def tie_weights_if_needed(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_layers, layer_hooks=None):
        """input_ids/positions [T] -> hidden states [T, hidden].

        kv_layers[i] = (k_cache, v_cache) views of layer i, each [num_blocks, block_size, Hkv, D].
        layer_hooks: an object with wait_for_layer_load(i) / save_kv_layer(i) (a connector
        worker), called before and after layer i.
        """
        x = self.embed_tokens(input_ids)
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)  # tables in float32, applied in x's
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            if layer_hooks is not None:
                layer_hooks.wait_for_layer_load(i)
            x = layer(x, cos, sin, meta, k_cache, v_cache)
            if layer_hooks is not None:
                layer_hooks.save_kv_layer(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already the rows to sample) -> logits [N, vocab] float32."""
        return self.lm_head(self.norm(hidden)).float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named Llama weights in, merging q/k/v and gate/up; every weight must be used."""
        own = dict(self.named_parameters())
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            used.add(name)
            return weights[name]

        r, n = self.shard.rank, self.shard.size

        def rows(w: torch.Tensor) -> torch.Tensor:  # this rank's output features
            step = w.shape[0] // n
            return w[r * step:(r + 1) * step]

        def cols(w: torch.Tensor) -> torch.Tensor:  # this rank's input features
            step = w.shape[1] // n
            return w[:, r * step:(r + 1) * step]

        attn_rows, attn_cols = (rows, cols) if self.shard.shards_attention else (_whole, _whole)

        with torch.no_grad():
            own["embed_tokens.weight"].copy_(take("model.embed_tokens.weight"))
            own["norm.weight"].copy_(take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                own["lm_head.weight"].copy_(take("lm_head.weight"))
            elif "lm_head.weight" in weights:
                used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
            for i in range(self.cfg.num_layers):
                p, hf = f"layers.{i}.", f"model.layers.{i}."
                own[p + "input_layernorm.weight"].copy_(take(hf + "input_layernorm.weight"))
                own[p + "post_attention_layernorm.weight"].copy_(
                    take(hf + "post_attention_layernorm.weight"))
                own[p + "self_attn.qkv_proj.weight"].copy_(torch.cat(
                    [attn_rows(take(hf + f"self_attn.{x}_proj.weight")) for x in "qkv"]))
                if self.cfg.qkv_bias:  # this rank's heads, like the weight rows
                    own[p + "self_attn.qkv_proj.bias"].copy_(torch.cat(
                        [attn_rows(take(hf + f"self_attn.{x}_proj.bias")) for x in "qkv"]))
                if self.cfg.qk_norm:
                    for x in "qk":
                        own[p + f"self_attn.{x}_norm.weight"].copy_(
                            take(hf + f"self_attn.{x}_norm.weight"))
                own[p + "self_attn.o_proj.weight"].copy_(
                    attn_cols(take(hf + "self_attn.o_proj.weight")))
                if i in self.cfg.moe_layers:  # the router and this rank's experts
                    self.layers[i].mlp.load(take, used.add, hf, self.cfg.family)
                    continue
                own[p + "mlp.gate_up_proj.weight"].copy_(torch.cat(
                    [rows(take(hf + "mlp.gate_proj.weight")), rows(take(hf + "mlp.up_proj.weight"))]))
                own[p + "mlp.down_proj.weight"].copy_(cols(take(hf + "mlp.down_proj.weight")))
        unused = sorted(set(weights) - used - {k for k in weights if "rotary_emb" in k})
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
