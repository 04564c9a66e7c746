"""Sampling parameters (validated at the boundary) and the batched sampler."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what a torch.Generator takes


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SamplingParams.{name} must be an integer {allowed}, got {value!r}")


def _check_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request."""

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus: keep the smallest set with this probability mass
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request RNG seed for reproducible sampling
    stop_token_ids: tuple[int, ...] = field(default=())  # extra ids that end generation
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        _check_real("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, 0)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("SamplingParams.stop_token_ids must be a sequence of ints, got "
                            f"{type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Picks one token per row of logits. Greedy rows are batched; others use a per-request
    generator so that a seeded request draws the same numbers whatever batch it lands in."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        # logits [N, vocab] float32
        tokens = logits.argmax(dim=-1).tolist()
        for row, (rid, sp) in enumerate(zip(request_ids, params)):
            if not sp.is_greedy:
                tokens[row] = self._sample_row(logits[row], rid, sp)
        return tokens

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _sample_row(self, logits: torch.Tensor, rid: str, sp: SamplingParams) -> int:
        gen = self._generators.get(rid)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(1 << 62, ())))
            self._generators[rid] = gen
        logits = logits.to("cpu", torch.float32) / sp.temperature
        if sp.top_k:
            kth = torch.topk(logits, min(sp.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep a token if the mass before it is still below top_p (the first always stays)
            drop = sorted_probs.cumsum(0) - sorted_probs >= sp.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen))
