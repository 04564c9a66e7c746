"""Sampling parameters (validated at the boundary) and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
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
