"""Llama-family decoder over a flat token batch with paged attention.

The forward takes the tokens of every scheduled request concatenated into one
`[num_tokens]` vector. Projections and the MLP run on all tokens at once; attention
reads and writes the paged KV cache through `AttentionMetadata` (built by the model
runner). Arithmetic follows `transformers`' Llama op for op so that greedy outputs
match it token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.model.attention_backend import TorchBackend, default_backend
from shoal.model.config import ModelConfig
from shoal.model.layers import MLP, RMSNorm
from shoal.model.loader import ModelSource
from shoal.model.mla import MLAttention
from shoal.model.moe import SparseMoE
from shoal.model.paged_attention import warm_up as paged_warm_up
from shoal.model.rope import apply_rope, rope_attention_factor, rope_inv_freq
from shoal.model.shard import Shard


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
    # the parts a prefill's contexts are split into (None: as the table's width says);
    # a CUDA graph fixes them at capture
    parts: int | None = None


@dataclass
class AttentionMetadata:
    """Where each new token's KV goes and what each request attends to."""

    slot_block_ids: torch.Tensor  # [T] block holding each token's KV slot
    slot_offsets: torch.Tensor  # [T] offset of that slot inside its block
    paged: PagedInputs
    dp_token_counts: list[int] | None = None  # ADP: every owner's tokens in this forward


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

    @property
    def fuses_rope_and_store(self) -> bool:
        """RoPE and the cache write in one kernel (the Triton backend; not with q/k norms,
        which come between the projection and RoPE)."""
        return self.backend.fused and self.q_norm is None

    def warm_up(self, k_cache, v_cache, scratch_block: int) -> None:
        """Compile the paged kernels now (the Triton backend's bring-up), and the fused rope
        and cache write (a row of zeros into the scratch block)."""
        q = k_cache.new_empty(1, self.num_heads, self.head_dim)
        paged_warm_up(q, k_cache, v_cache, scratch_block)
        if self.fuses_rope_and_store:
            from shoal.model.fused_ops import rope_store
            qkv, trig = k_cache.new_zeros(1, sum(self.split)), k_cache.new_zeros(1, self.head_dim)
            at = torch.full((1,), scratch_block, dtype=torch.int32, device=k_cache.device)
            rope_store(qkv, trig, trig, self.num_heads, self.num_kv_heads, self.head_dim,
                       k_cache, v_cache, at, at * 0)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        # x [T, hidden]; cos/sin [T, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = self.fuses_rope_and_store
        if fused:  # q rotated in place, k rotated and v written into their slots: one kernel
            from shoal.model.fused_ops import rope_store
            rope_store(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim,
                       k_cache, v_cache, meta.slot_block_ids, meta.slot_offsets)
        q, k, v = (t.view(num_tokens, n, self.head_dim) for t, n in zip(
            qkv.split(self.split, dim=-1), (self.num_heads, self.num_kv_heads, self.num_kv_heads)))
        if not fused:
            if self.q_norm is not None:  # per head, before RoPE (as transformers' Qwen3)
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.backend.store(k, v, k_cache, v_cache, meta)
        # an ADP padding step (no tokens: this owner has nothing, its peers do) attends nothing
        out = self.backend.attend(q, meta, k_cache, v_cache) if num_tokens else q
        out = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return self.shard.all_reduce_(out) if self.shard.shards_attention else out

    def load(self, take, prefix: str) -> None:
        """Copy in HF weights `prefix + name` (q/k/v merged): this rank's heads."""
        rows = self.shard.head_rows
        self.qkv_proj.weight.copy_(torch.cat([rows(take(f"{prefix}{x}_proj.weight")) for x in "qkv"]))
        if self.qkv_proj.bias is not None:  # this rank's heads, like the weight rows
            self.qkv_proj.bias.copy_(torch.cat([rows(take(f"{prefix}{x}_proj.bias")) for x in "qkv"]))
        if self.q_norm is not None:
            self.q_norm.weight.copy_(take(prefix + "q_norm.weight"))
            self.k_norm.weight.copy_(take(prefix + "k_norm.weight"))
        self.o_proj.weight.copy_(self.shard.head_cols(take(prefix + "o_proj.weight")))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, shard: Shard, backend):
        super().__init__()
        self.backend = backend
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (MLAttention(cfg, layer_idx, shard, backend) if cfg.is_mla
                          else Attention(cfg, layer_idx, shard, backend))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (SparseMoE(cfg, shard, backend) if layer_idx in cfg.moe_layers
                    else MLP(cfg.hidden_size, cfg.intermediate_size, shard, backend))

    def forward(self, x, residual, cos, sin, meta, k_cache, v_cache):
        """-> (h, residual): the layer's output is h + residual, a sum left to the next
        layer's fused add + norm (or the model's end); `residual` None: x is the input."""
        if not self.backend.fused:  # the reference ops
            x = x if residual is None else x + residual
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
            return self.mlp(self.post_attention_layernorm(x), meta), x
        from shoal.model.fused_ops import add_rms_norm, rms_norm  # fused kernels
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            h, residual = rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn(h, cos, sin, meta, k_cache, v_cache)
        h, residual = add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp(h, meta), residual


def check_shardable(cfg: ModelConfig, size: int, field: str = "tp_size") -> None:
    """ValueError unless `size` divides every dimension the split touches (ADP, named by
    field="dp_size", splits only the MLP: the dense one by columns, the experts by expert)."""
    dims = []
    if len(cfg.moe_layers) < cfg.num_layers:  # some layer has the dense MLP
        dims.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe_layers:
        dims.append(("num_experts", cfg.num_experts))
    if cfg.num_shared_experts:
        dims.append(("shared experts' width", cfg.moe_intermediate_size * cfg.num_shared_experts))
    if field == "tp_size":  # the heads (MLA: the latent is whole on every rank)
        heads = [("num_heads", cfg.num_heads)]
        if not cfg.is_mla:
            heads.append(("num_kv_heads", cfg.num_kv_heads))
        dims = [*heads, *dims]
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
        # no random init (the weights are loaded): on the meta device it would import
        # torch._dynamo, about 1.8 s of every process's first engine
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, self.backend)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights_if_needed()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_factor = rope_attention_factor(cfg)

    def to_dtype(self, dtype: torch.dtype) -> "LlamaModel":
        """The parameters in `dtype`, but for what the family keeps in float32 (DeepSeek's
        router and its expert bias, as transformers does)."""
        self.to(dtype)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.router_to_float32()
        return self

    def attention_weight(self) -> float:
        """What one (query, key) pair of prefill attention costs against one token through
        the layers' weights, on this rank: 2 (d_qk + d_v) FLOPs per head and layer against
        2 per weight a token meets (of the experts, k in E). Under ADP a rank's MLP and
        experts run every owner's tokens (Shard.every_token), so a token of its own meets
        size times their local share. A long prefill's per-token cost grows with its context
        by this much (the load split's cost model). Not counted: MLA's expanded prefill also
        runs kv_b over the context before each chunk."""
        cfg = self.cfg
        d_qk, d_v = ((cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim) if cfg.is_mla
                     else (cfg.head_dim, cfg.head_dim))
        pair = (d_qk + d_v) * self.layers[0].self_attn.num_heads * cfg.num_layers
        every_token = 1 if self.shard.shards_attention else self.shard.size

        def weights(module: nn.Module) -> float:
            if isinstance(module, nn.Linear):
                return module.weight.numel()
            if isinstance(module, SparseMoE):  # its router, k in E of the experts, shared
                share = cfg.num_experts_per_tok / cfg.num_experts
                shared = 0 if module.shared is None else weights(module.shared)
                return (module.gate.weight.numel() + shared
                        + share * (module.gate_up.numel() + module.down.numel()))
            return sum(weights(m) for m in module.children())
        total = sum(weights(layer.self_attn) + every_token * weights(layer.mlp)
                    for layer in self.layers)
        return pair / total if total else 0.0

    def use_backend(self, backend) -> None:
        """Read and write the cache through `backend` from now on (every layer)."""
        for module in self.modules():
            if "backend" in module.__dict__:
                module.backend = backend

    def tie_weights_if_needed(self) -> None:
        """Share the embedding with the LM head (again once storage is allocated, which unties)."""
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
        cos, sin = emb.cos(), emb.sin()  # tables in float32, applied in x's dtype
        if self.rope_factor != 1.0:  # YaRN
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_layers)):
            if layer_hooks is not None:
                layer_hooks.wait_for_layer_load(i)
            x, residual = layer(x, residual, cos, sin, meta, k_cache, v_cache)
            if layer_hooks is not None:
                layer_hooks.save_kv_layer(i)
        return x if residual is None else x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (already the rows to sample) -> logits [N, vocab] float32."""
        return self.lm_head(self.norm(hidden)).float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (each layer takes its own, merging q/k/v and gate/up and
        keeping this rank's share); every weight must be used."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            used.add(name)
            return weights[name]

        with torch.no_grad():
            self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.weight.copy_(take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            elif "lm_head.weight" in weights:
                used.add("lm_head.weight")  # some tied checkpoints store the copy anyway
            for i, layer in enumerate(self.layers):
                hf = f"model.layers.{i}."
                layer.input_layernorm.weight.copy_(take(hf + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(
                    take(hf + "post_attention_layernorm.weight"))
                layer.self_attn.load(take, hf + "self_attn.")
                if i in self.cfg.moe_layers:  # the router and this rank's experts
                    layer.mlp.load(take, used.add, hf)
                else:
                    layer.mlp.load(take, hf + "mlp.")
        unused = sorted(set(weights) - used - {k for k in weights if self._ignored(k)})
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")

    def _ignored(self, name: str) -> bool:
        """Weights a checkpoint may carry that Shoal does not use: rotary tables, and
        DeepSeek-V3's multi-token prediction layers (numbered after the last layer)."""
        if "rotary_emb" in name:
            return True
        parts = name.split(".")
        return (self.cfg.family == "deepseek_v3" and name.startswith("model.layers.")
                and int(parts[2]) >= self.cfg.num_layers)


def build_model(source: ModelSource, shard: Shard, device: torch.device,
                dtype: torch.dtype) -> LlamaModel:
    """The model of `source` (its shard), its weights loaded on `device` in `dtype`; the
    source's weights are let go."""
    with torch.device("meta"):
        model = LlamaModel(source.config, shard, default_backend(device))
    model = _allocate(model.to_dtype(dtype), device)  # storage allocated once, in its dtype
    model.tie_weights_if_needed()
    # float32 whatever the dtype (as transformers)
    model.inv_freq = rope_inv_freq(source.config).to(device)
    model.load_hf_state_dict(source.weights)
    model.eval()
    del source.weights
    return model


def _allocate(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Uninitialised storage on `device` for each parameter and buffer on the meta device
    (the weights are loaded next). As Module.to_empty, without its empty_like, whose meta
    implementation loads about half a second of torch's Python into every process."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model
