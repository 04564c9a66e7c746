"""Engine configuration: frozen, validated once at bring-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shoal.connectors.base import ConnectorConfig

MAX_CPU_RANKS = 16  # rank processes one machine may spawn for CPU runs
_OPTIONAL = ("num_kv_blocks", "max_model_len")  # None: sized or capped by the model
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. Run-time discoveries (e.g. the number of KV blocks a
    memory budget buys) are returned by whoever discovers them, never written back here."""

    model: str = "smollm2"  # preset name, HF directory or .gguf path
    block_size: int = 16  # token slots per KV block
    max_batch_size: int = 64  # requests in one step at most
    max_num_tokens: int = 2048  # tokens in one step at most (prefill chunks + decodes)
    num_kv_blocks: int | None = None  # KV blocks per rank; None = as many as kv_cache_gb buys
    kv_cache_gb: float = 1.0  # KV cache memory per rank when num_kv_blocks is None
    max_model_len: int | None = None  # context cap; None = the model's own
    overlap_scheduler: bool = True  # schedule step N+1 while step N runs
    enable_prefix_caching: bool = True  # reuse full blocks across requests on a rank
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"  # weights and KV cache; auto: bfloat16 on CUDA, float32 on CPU
    enforce_eager: bool = False  # CUDA: never replay captured graphs (decode, short prefill)
    dp_size: int = 1  # attention data-parallel ranks
    tp_size: int = 1  # tensor-parallel ranks
    # one rank's engine in a process of its own (as tp/dp ranks are), driven over a pipe:
    # the caller's Python (a server's HTTP, detokenizing) never holds the engine's GIL
    engine_process: bool = False
    kv_connector: ConnectorConfig | None = None  # the KV pool connector; None = no pool

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch_size", "max_num_tokens", "dp_size", "tp_size",
                     *_OPTIONAL):
            value, high = getattr(self, name), 4096 if name == "block_size" else math.inf
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if not ((is_int and 1 <= value <= high) or (value is None and name in _OPTIONAL)):
                allowed = f"in [1, {high}]" if high < math.inf else ">= 1"
                raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
        if (isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, (int, float))
                or not math.isfinite(self.kv_cache_gb) or self.kv_cache_gb <= 0):
            raise ValueError(f"kv_cache_gb must be a finite number > 0, got {self.kv_cache_gb!r}")
        for name in ("overlap_scheduler", "enable_prefix_caching", "enforce_eager",
                     "engine_process"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a preset name or a path, got {self.model!r}")
        if self.kv_connector is not None and not isinstance(self.kv_connector, ConnectorConfig):
            raise ValueError("kv_connector must be a shoal.connectors.ConnectorConfig, got "
                             f"{type(self.kv_connector).__name__}")
        if self.dp_size > 1 and self.tp_size > 1:
            raise ValueError(f"dp_size={self.dp_size} with tp_size={self.tp_size}: combining "
                             "attention DP and TP is not supported (set one of them to 1)")
        max_ranks = torch.cuda.device_count() if self.device.startswith("cuda") else MAX_CPU_RANKS
        for name in ("tp_size", "dp_size"):
            if getattr(self, name) > max_ranks:
                raise ValueError(f"{name}={getattr(self, name)} is more ranks than allowed on "
                                 f"{self.device} (allowed: 1..{max_ranks})")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype "auto" stands for: bfloat16 on CUDA, float32 on CPU (where half-precision
        matrix products are far slower)."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]
