"""Architecture description of a Llama-family model, read from HF config.json or GGUF."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (None on a ModelConfig means plain RoPE)."""

    factor: float  # how much longer than the original context the model was tuned for
    low_freq_factor: float  # wavelengths above original/low_freq_factor are divided by factor
    high_freq_factor: float  # wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int  # context length before scaling


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # longest context the model accepts
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

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

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): part of the model identity hashed into block keys."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF `config.json` dict (LlamaConfig fields)."""
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
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
