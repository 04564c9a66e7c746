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

The mixture-of-experts families replace the MLP of some layers (Qwen3-MoE: those its
`decoder_sparse_step` and `mlp_only_layers` pick; Mixtral: all) with top-k routed experts
(shoal/model/moe.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


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
}
HF_ARCHITECTURES = {f.hf_architecture: name for name, f in FAMILIES.items()}


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (None on a ModelConfig means plain RoPE)."""

    factor: float  # how much longer than the original context the model was tuned for
    low_freq_factor: float  # wavelengths above original/low_freq_factor are divided by factor
    high_freq_factor: float  # wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int  # context length before scaling

    @classmethod
    def from_freq_factors(cls, factors: list[float], rope_theta: float,
                          head_dim: int) -> "RopeScaling | None":
        """The llama3 parameters that reproduce llama.cpp's per-frequency divisors (GGUF
        `rope_freqs`: frequency i is divided by factors[i]); None when every divisor is 1.

        llama.cpp bakes the scaling into that tensor and keeps no parameters. Only factor,
        original/low_freq_factor and original/high_freq_factor are observable (scaling the
        three together changes no frequency), so low_freq_factor is taken as 1, as in every
        Llama 3.x release; the rest is fitted on the smoothed band and then checked against
        every divisor. ValueError when no llama3 parameters reproduce them."""
        if len(factors) != head_dim // 2:
            raise ValueError(f"rope_freqs has {len(factors)} entries, expected head_dim/2 = "
                             f"{head_dim // 2}")
        if all(abs(f - 1) < 1e-6 for f in factors):
            return None
        wavelens = _wavelengths(rope_theta, head_dim)
        factor = max(factors)
        # In the band, 1/f = (1 - s)/factor + s, with s linear in 1/wavelen:
        #   s = original/(high - 1) * (1/wavelen) - 1/(high - 1)        (low_freq_factor = 1)
        band = [(1 / w, (1 / f - 1 / factor) / (1 - 1 / factor))
                for w, f in zip(wavelens, factors) if 1 + 1e-6 < f < factor * (1 - 1e-6)]
        if len(band) < 2:
            raise ValueError(f"rope_freqs has {len(band)} smoothed entries; at least 2 are "
                             "needed to recover its llama3 RoPE scaling")
        slope, intercept = _fit_line(band)
        if intercept >= 0 or slope <= 0:
            raise ValueError("rope_freqs is not a llama3 RoPE scaling (its smoothed band "
                             "does not grow with frequency)")
        high = 1 - 1 / intercept
        scaling = cls(factor=round(factor, 4), low_freq_factor=1.0,
                      high_freq_factor=round(high, 4),
                      original_max_position_embeddings=round(slope * (high - 1)))
        expected = scaling.freq_factors(rope_theta, head_dim)
        worst = max(abs(a - b) / b for a, b in zip(factors, expected))
        if worst > 1e-4:
            raise ValueError(f"rope_freqs is not a llama3 RoPE scaling (the closest, {scaling}, "
                             f"is off by {worst:.2g} relative)")
        return scaling

    def freq_factors(self, rope_theta: float, head_dim: int) -> list[float]:
        """llama.cpp's divisor per frequency [head_dim/2] (its converter's formula)."""
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for w in _wavelengths(rope_theta, head_dim):
            if w < high_wavelen:
                out.append(1.0)
            elif w > low_wavelen:
                out.append(self.factor)
            else:
                s = ((self.original_max_position_embeddings / w - self.low_freq_factor)
                     / (self.high_freq_factor - self.low_freq_factor))
                out.append(1 / ((1 - s) / self.factor + s))
        return out


def _wavelengths(rope_theta: float, head_dim: int) -> list[float]:
    return [2 * math.pi * rope_theta ** (i / head_dim) for i in range(0, head_dim, 2)]


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept through (x, y) points (at least two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x, _ in points))
    return slope, my - slope * mx


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
    head_dim: int  # explicit in Qwen3 and some Mistrals (not hidden_size / num_heads)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # longest context the model accepts
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
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
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
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
        )


def _hf_moe(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config (none for a dense family)."""
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
