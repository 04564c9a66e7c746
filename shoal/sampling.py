"""Sampling parameters (validated at the boundary) and the batched sampler."""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, field

import torch


SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what a torch.Generator takes
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)


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
    min_tokens: int = 0  # stop tokens (eos included) do not end the request before this many
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k (<= 20)

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
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model (log_softmax of the raw logits,
    before temperature, top-k and top-p) and the most likely tokens of that position."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; k entries


def compute_logprobs(logits: torch.Tensor, token_ids: list[int],
                     num_top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row of `logits` [N, vocab]: the logprobs of `token_ids[row]` and the top
    `num_top[row]` tokens, or None where the row's request did not ask (num_top None).
    Separate from the sampler: only the rows that asked are touched."""
    rows = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(num_top)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [R, vocab]
    sampled = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen = logp.gather(1, sampled[:, None])[:, 0].tolist()
    k = max(num_top[i] for i in rows)
    top_values, top_ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = num_top[i]
        out[i] = TokenLogprobs(chosen[j], tuple(zip(top_ids[j][:n], top_values[j][:n])))
    return out


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9),
                         _signed(0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def gumbel_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float64 Gumbel noise, a pure function of (seed, draw, token id): a counter-
    based hash (splitmix64 finaliser) instead of a generator's state, so a request's draws
    are the same in any batch, on any device and on every TP rank. int64 products wrap."""
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] * _GOLDEN + draws[:, None] * _MIX1 + v[None, :]
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 11).double() + 0.5) * 2.0 ** -53  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


class Sampler:
    """Picks one token per row of logits, on the logits' device, in one batch: greedy rows
    by argmax; the others by the Gumbel-max trick over their temperature-scaled, top-k and
    top-p filtered logits, with noise from `gumbel_noise`, so a seeded request draws the
    same tokens whatever batch it lands in. No host sync: the tokens stay on the device
    (`sample_on_device`) until the caller copies them."""

    def __init__(self) -> None:
        self._draws: dict[str, tuple[int, int]] = {}  # rid -> (seed, draws so far)

    def sample(self, logits: torch.Tensor, request_ids: list[str],
               params: list[SamplingParams]) -> list[int]:
        return self.sample_on_device(logits, request_ids, params).tolist()

    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str],
                         params: list[SamplingParams]) -> torch.Tensor:
        """logits [N, vocab] float32 -> [N] int64 token ids on the logits' device."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, sp in enumerate(params) if not sp.is_greedy]
        if rows:
            device = logits.device
            sub = [params[i] for i in rows]
            index = torch.tensor(rows, device=device)
            scaled = logits.index_select(0, index).float() / torch.tensor(
                [sp.temperature for sp in sub], device=device)[:, None]
            filtered = _top_k_top_p(scaled, [sp.top_k for sp in sub], [sp.top_p for sp in sub])
            seeds, draws = zip(*(self._next_draw(request_ids[i], params[i]) for i in rows))
            noise = gumbel_noise(torch.tensor(seeds, device=device),
                                 torch.tensor(draws, device=device), logits.shape[1])
            tokens[index] = (filtered.double() + noise).argmax(dim=-1)
        return tokens

    def forget(self, request_id: str) -> None:
        self._draws.pop(request_id, None)

    def _next_draw(self, rid: str, sp: SamplingParams) -> tuple[int, int]:
        seed, n = self._draws.get(rid) or (
            _signed(sp.seed if sp.seed is not None else random.getrandbits(63)), 0)
        self._draws[rid] = (seed, n + 1)
        return seed, n


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Rows of `logits` with tokens outside each row's top k (0: all) and outside its top-p
    nucleus set to -inf. The nucleus keeps a token while the probability mass before it is
    below top_p (the most likely token always stays)."""
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    k = torch.tensor([min(k, vocab) if k else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype)[:, None]
    drop |= (probs.cumsum(dim=-1) - probs >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
