"""Architecture description of a supported decoder, read from HF config.json or GGUF.

Every family Shoal serves is a Llama-shaped decoder (RMSNorm, RoPE, GQA, SwiGLU) with a
few switches; `FAMILIES` names them and `ModelConfig` carries the switches:

    family    HF architectures entry   GGUF architecture   q/k/v bias   q/k RMSNorm
    llama     LlamaForCausalLM         llama                -            -
    mistral   MistralForCausalLM       (llama)              -            -
    qwen2     Qwen2ForCausalLM         qwen2                yes          -
    qwen3     Qwen3ForCausalLM         qwen3                -            yes
    qwen3_moe Qwen3MoeForCausalLM      -                    -            yes    routed experts
    mixtral   MixtralForCausalLM       -                    -            -      routed experts
    deepseek_v2  DeepseekV2ForCausalLM -                    MLA                 routed + shared
    deepseek_v3  DeepseekV3ForCausalLM -                    MLA                 routed + shared

The mixture-of-experts families replace the MLP of some layers (Qwen3-MoE: those its
`decoder_sparse_step` and `mlp_only_layers` pick; Mixtral: all; DeepSeek: from
`first_k_dense_replace` on) with top-k routed experts (shoal/model/moe.py). DeepSeek's
attention is multi-head latent attention (shoal/model/mla.py): each token keeps one
compressed latent and one rotary key per layer instead of K and V per head.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from shoal.model.rope_scaling import RopeScaling, YarnScaling


@dataclass(frozen=True)
class Family:
    """What sets a family apart from Llama."""

    hf_architecture: str  # the `architectures` entry of its config.json
    qkv_bias: bool  # q/k/v projections carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k, after the projection and before RoPE


FAMILIES = {
    "llama": Family("LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "mistral": Family("MistralForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True),
    "mixtral": Family("MixtralForCausalLM", qkv_bias=False, qk_norm=False),
    "deepseek_v2": Family("DeepseekV2ForCausalLM", qkv_bias=False, qk_norm=False),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", qkv_bias=False, qk_norm=False),
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
# how the router picks a token's experts (the names of DeepSeek's configs):
#   greedy                the top k of the softmax scores
#   group_limited_greedy  the same among the experts of the topk_groups groups whose best
#                         score is highest (DeepSeek-V2)
#   noaux_tc              sigmoid scores plus a per-expert bias choose (the bias only
#                         chooses, it does not weigh), within the topk_groups groups whose
#                         two best biased scores sum highest (DeepSeek-V3)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
HF_ARCHITECTURES = {f.hf_architecture: name for name, f in FAMILIES.items()}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes, constants and family switches of a Llama-shaped decoder. Every field is part
    of `to_json`, the model identity hashed into block keys, so families never share keys."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int  # explicit in Qwen3 and some Mistrals (not hidden_size / num_heads); MLA:
    # the rotary part of q and k only (qk_rope_head_dim)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # longest context the model accepts
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | YarnScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    family: str = "llama"  # a key of FAMILIES
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # mixture of experts (0 experts: every layer has the dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # the top k of the router
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the top k weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = field(default=())  # layers whose MLP is the experts
    num_shared_experts: int = 0  # experts every token goes through (DeepSeek)
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it
    topk_method: str = "greedy"  # one of TOPK_METHODS
    num_expert_groups: int = 1  # the group-limited methods: experts in this many groups,
    topk_groups: int = 1  # of which this many are chosen from
    # multi-head latent attention (DeepSeek; kv_lora_rank 0: K and V per head)
    kv_lora_rank: int = 0  # the latent each token keeps per layer
    q_lora_rank: int = 0  # q through a low-rank bottleneck of this width (0: one projection)
    qk_nope_head_dim: int = 0  # per head, the q/k dimensions without rotation
    v_head_dim: int = 0  # per head, the value dimensions
    rope_interleave: bool = False  # rotary pairs (2i, 2i+1) instead of (i, i + head_dim/2)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {sorted(FAMILIES)}, "
                             f"got {self.family!r}")
        if self.moe_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1:
                raise ValueError("ModelConfig.moe_intermediate_size must be >= 1, got "
                                 f"{self.moe_intermediate_size}")
            if not all(0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"ModelConfig.moe_layers must be layer indices below "
                                 f"{self.num_layers}, got {self.moe_layers}")
            self._check_routing()
        if self.kv_lora_rank:
            for name in ("qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"ModelConfig.{name} must be >= 1 with multi-head latent "
                                     f"attention, got {getattr(self, name)}")

    def _check_routing(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"ModelConfig.topk_method must be one of {TOPK_METHODS}, got "
                             f"{self.topk_method!r}")
        groups = self.num_expert_groups
        if groups < 1 or self.num_experts % groups:
            raise ValueError(f"ModelConfig.num_expert_groups ({groups}) must divide num_experts "
                             f"({self.num_experts})")
        if not 1 <= self.topk_groups <= groups:
            raise ValueError(f"ModelConfig.topk_groups must be in [1, num_expert_groups="
                             f"{groups}], got {self.topk_groups}")
        if self.topk_method != "greedy" and (
                self.num_experts_per_tok > self.topk_groups * (self.num_experts // groups)):
            raise ValueError(f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must "
                             f"fit in topk_groups={self.topk_groups} groups of "
                             f"{self.num_experts // groups} experts")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: the cache keeps a latent per token, not K and V."""
        return self.kv_lora_rank > 0

    def kv_token_shape(self, attention_size: int = 1) -> tuple[int, int, int]:
        """(parts, heads, dim) of one token's KV in one layer on a rank that holds
        1/attention_size of the heads: K and V of its kv heads, or (MLA) one part holding
        the latent and the rotary key, the same on every rank."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.head_dim
        return 2, self.num_kv_heads // attention_size, self.head_dim

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): part of the model identity hashed into block keys."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dict; ValueError for what Shoal does not run."""
        family = hf_family(cfg)
        _check_hf_supported(cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if family in DEEPSEEK:
            head_dim = cfg["qk_rope_head_dim"]
        # transformers 4.x calls it rope_scaling, 5.x rope_parameters (which also holds theta).
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        elif rope_type == "yarn":
            scaling = YarnScaling.from_hf(rope, cfg.get("max_position_embeddings", 2048))
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, "
                             "llama3, yarn)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_len = cfg.get("max_position_embeddings", 2048)
        window = hf_sliding_window(cfg, family)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=max_len if window is None else min(max_len, window),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family,
            qkv_bias=FAMILIES[family].qkv_bias,
            qk_norm=FAMILIES[family].qk_norm,
            **_hf_moe(cfg, family),
            **_hf_mla(cfg, family),
        )


def _hf_mla(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The latent attention fields of a DeepSeek config (none for the other families)."""
    if family not in DEEPSEEK:
        return {}
    return dict(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
                # V2 rotates pairs (as complex numbers); V3 says so, and does by default
                rope_interleave=family == "deepseek_v2" or bool(cfg.get("rope_interleave", True)))


def _hf_moe(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config (none for a dense family)."""
    if family in DEEPSEEK:
        return _hf_deepseek_moe(cfg, family)
    if family not in ("qwen3_moe", "mixtral"):
        return {}
    # transformers 5 writes num_local_experts; the hub's Qwen3-MoE configs say num_experts
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    num_layers = cfg["num_hidden_layers"]
    if family == "mixtral":
        layers = tuple(range(num_layers)) if num_experts else ()
        width, norm = cfg["intermediate_size"], True
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers)
                       if num_experts and i not in dense and (i + 1) % step == 0)
        width, norm = cfg.get("moe_intermediate_size", 0), bool(cfg.get("norm_topk_prob", False))
    return dict(num_experts=num_experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(width), norm_topk_prob=norm, moe_layers=layers)


def _hf_deepseek_moe(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    num_experts = int(cfg.get("n_routed_experts") or 0)
    first, every = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
    layers = tuple(i for i in range(cfg["num_hidden_layers"])
                   if num_experts and i >= first and i % every == 0)
    norm = bool(cfg.get("norm_topk_prob"))
    if family == "deepseek_v2" and norm and num_experts:
        # no released V2 sets it, and DeepSeek's code and transformers' disagree on its meaning
        raise ValueError("config.json norm_topk_prob=true is not supported for DeepSeek-V2")
    method = "noaux_tc" if family == "deepseek_v3" else (cfg.get("topk_method") or "greedy")
    return dict(num_experts=num_experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
                norm_topk_prob=norm, moe_layers=layers,
                num_shared_experts=int(cfg.get("n_shared_experts") or 0),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                topk_method=method, num_expert_groups=int(cfg.get("n_group") or 1),
                topk_groups=int(cfg.get("topk_group") or 1))


def hf_family(cfg: dict[str, Any]) -> str:
    """The family of a HF config: from `architectures`, else `model_type`, else llama."""
    supported = ", ".join(HF_ARCHITECTURES)
    for arch in cfg.get("architectures") or []:
        if arch not in HF_ARCHITECTURES:
            raise ValueError(f"config.json architectures entry {arch!r} is not supported "
                             f"(supported: {supported})")
    if cfg.get("architectures"):
        return HF_ARCHITECTURES[cfg["architectures"][0]]
    model_type = cfg.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(FAMILIES)})")
    return model_type


def _check_hf_supported(cfg: dict[str, Any]) -> None:
    """ValueError naming the first field whose value the shared decoder cannot run."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which no served
    # checkpoint of these families has; Qwen2's q/k/v bias is implied by its architecture.
    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise ValueError(f"config.json {name}=true is not supported")
    if cfg.get("quantization_config"):  # DeepSeek-V3's hub weights are fp8 blocks
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"config.json quantization_config ({method}) is not supported: use "
                         "the checkpoint's bf16 weights")


def hf_sliding_window(cfg: dict[str, Any], family: str) -> int | None:
    """The attention window when any layer slides, else None.

    Shoal attends over the whole context, which equals sliding-window attention as long as
    the context fits in the window; the caller caps the context there instead of refusing
    (Mistral 7B v0.1: 32k positions, 4096 window)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if cfg.get("layer_types") is not None:
        slides = "sliding_attention" in cfg["layer_types"]
    elif family in ("mistral", "mixtral"):
        slides = True  # Mistral has no switch: a window set is a window used
    else:
        slides = bool(cfg.get("use_sliding_window"))
    return int(window) if slides else None
