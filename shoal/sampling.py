"""Sampling parameters (validated at the boundary) and the batched sampler."""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, field
from functools import cached_property

import torch

from shoal.logits_processing import (TokenCounts, add_at, apply_penalties, gumbel_noise,
                                     min_p_filter, signed64, top_k_top_p_filter)
# (re-exported: the logprobs a request may ask for, and their records in its output)
from shoal.logits_processing import TokenLogprobs as TokenLogprobs
from shoal.logits_processing import compute_logprobs as compute_logprobs
from shoal.structured_output import Grammars, StructuredOutput, mask_logits_
from shoal.util import HostCopy, to_device

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what a torch.Generator takes
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token (OpenAI's limit)
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids one request may bias (OpenAI's limit)


# the numeric fields' ranges. Integers: (low, high); high None: no bound. Reals: (low,
# high, whether low itself is refused); math.inf: no bound
_INT_RANGES = {"max_tokens": (1, None), "top_k": (0, None), "seed": (SEED_MIN, SEED_MAX),
               "logprobs": (0, MAX_LOGPROBS), "prompt_logprobs": (0, MAX_LOGPROBS)}
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs")  # None: off
_REAL_RANGES = {"temperature": (0.0, math.inf, False), "top_p": (0.0, 1.0, True),
                "min_p": (0.0, 1.0, False), "repetition_penalty": (0.0, math.inf, True),
                "frequency_penalty": (-2.0, 2.0, False), "presence_penalty": (-2.0, 2.0, False)}


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SamplingParams.{name} must be an integer {allowed}, got {value!r}")


def _check_real(name: str, value, low: float = -math.inf, high: float = math.inf,
                open_low: bool = False) -> None:
    """ValueError unless `value` is a finite number in [low, high] ((low, high] if open_low)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r}")
    if value < low or value > high or (open_low and value == low):
        allowed = (f"{'>' if open_low else '>='} {low:g}" if high == math.inf else
                   f"in {'(' if open_low else '['}{low:g}, {high:g}]")
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


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
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    repetition_penalty: float = 1.0  # > 0; 1 = off (prompt and output tokens, HF's rule)
    frequency_penalty: float = 0.0  # [-2, 2]; minus this x the count of a token in the output
    presence_penalty: float = 0.0  # [-2, 2]; minus this once a token is in the output
    # (token id, bias in [-100, 100]) added to the logits; a dict {id: bias} is taken too
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    # None: off; k: each prompt token's logprob (the first has none) and the top k (<= 20);
    # the prompt is then computed whole (no prefix cache or pool hit serves it)
    prompt_logprobs: int | None = None
    # the output must match this (a JSON schema, a regex, a choice, a grammar); None: free
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        for name, (low, high) in _INT_RANGES.items():
            if name not in _OPTIONAL or getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low, high)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name, bounds in _REAL_RANGES.items():
            _check_real(name, getattr(self, name), *bounds)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("SamplingParams.stop_token_ids must be a sequence of ints, got "
                            f"{type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not isinstance(self.structured_output, (StructuredOutput, type(None))):
            raise TypeError("SamplingParams.structured_output must be a StructuredOutput, got "
                            f"{type(self.structured_output).__name__}")

    @property
    def has_penalties(self) -> bool:
        """Whether the request's output (and, for repetition, prompt) tokens shape its logits."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property  # (a frozen dataclass: cached in the instance's __dict__, never a field)
    def is_plain(self) -> bool:
        """Greedy, and nothing shapes its logits: its token is their argmax."""
        return (self.is_greedy and not (self.has_penalties or self.logit_bias or self.min_tokens)
                and self.structured_output is None)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs; ValueError/TypeError naming the field."""
    items = bias.items() if isinstance(bias, dict) else bias
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError("SamplingParams.logit_bias must map token ids to biases, got "
                        f"{type(bias).__name__}")
    pairs = {}
    for token, value in items:
        _check_int("logit_bias", token, 0)
        _check_real("logit_bias", value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"SamplingParams.logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")
        pairs[int(token)] = float(value)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"SamplingParams.logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} "
                         f"token ids, got {len(pairs)}")
    return tuple(sorted(pairs.items()))


class Sampler:
    """Picks one token per row of logits, in one batch on the logits' device (no host sync).
    Each row's own settings shape its logits (shoal.logits_processing); greedy rows take the
    argmax, the others the Gumbel-max over their filtered logits (`gumbel_noise`: a seeded
    request draws the same tokens in any batch). `rows` are the requests (request_id,
    sampling, stop_token_ids, prompt_token_ids), one per row, each sampled once per call."""

    def __init__(self, grammars: Grammars | None = None) -> None:
        self.grammars = grammars  # None: structured output is not available (no tokenizer)
        self._draws: dict[str, tuple[int, int]] = {}  # rid -> (seed, draws so far)
        self._num_sampled: dict[str, int] = {}  # rid -> tokens sampled (min_tokens requests)
        self._counts: TokenCounts | None = None  # output tokens of penalised requests

    def sample(self, logits: torch.Tensor, rows) -> list[int]:
        return self.sample_on_device(logits, rows).tolist()

    def sample_on_device(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """logits [N, vocab] float32 -> [N] int64 token ids on the logits' device."""
        params = [r.sampling for r in rows]
        if all(sp.is_plain for sp in params):  # (a step of greedy rows: the argmax alone)
            return logits.argmax(dim=-1)
        raw = logits
        logits, counted = self._shape(logits, rows)
        structured = [i for i, sp in enumerate(params) if sp.structured_output is not None]
        if structured:
            logits, structured_index = self._constrain(logits, rows, structured,
                                                       own=logits is not raw)
        tokens = logits.argmax(dim=-1)
        picked = [i for i, sp in enumerate(params) if not sp.is_greedy]
        if picked:
            device = logits.device
            sub = [params[i] for i in picked]
            index = to_device(picked, device)
            scaled = logits.index_select(0, index) / to_device(
                [sp.temperature for sp in sub], device, logits.dtype)[:, None]
            if any(sp.min_p for sp in sub):
                scaled = min_p_filter(scaled, to_device([sp.min_p for sp in sub], device,
                                                        logits.dtype))
            filtered = top_k_top_p_filter(scaled, [sp.top_k for sp in sub],
                                          [sp.top_p for sp in sub])
            seeds, draws = zip(*(self._next_draw(rows[i].request_id, params[i]) for i in picked))
            noise = gumbel_noise(to_device(seeds, device), to_device(draws, device),
                                 logits.shape[1])
            tokens[index] = (filtered.double() + noise).argmax(dim=-1)
        if counted is not None:  # the penalised rows' counts take their new tokens
            index, slab_rows = counted
            self._counts.add(slab_rows, tokens.index_select(0, index))
        if structured:  # their next masks, started now (Grammars.prepare)
            self.grammars.prepare([rows[i] for i in structured],
                                  HostCopy(tokens.index_select(0, structured_index)))
        for r in rows:
            if r.sampling.min_tokens:
                self._num_sampled[r.request_id] = self._num_sampled.get(r.request_id, 0) + 1
        return tokens

    def forget(self, request_id: str) -> None:
        self._draws.pop(request_id, None)
        self._num_sampled.pop(request_id, None)
        if self._counts is not None:
            self._counts.forget(request_id)
        if self.grammars is not None:
            self.grammars.forget(request_id)

    def _constrain(self, logits: torch.Tensor, rows, structured: list[int], own: bool):
        """(logits with every token the structured rows' grammars forbid at -inf, those
        rows' index on the device). A row left with no token gets its first stop token
        (it ends; never a failure). `own`: `logits` is this call's copy (else copied)."""
        if self.grammars is None:
            raise RuntimeError("structured output needs the model's tokenizer")
        sub_rows = [rows[i] for i in structured]
        bitmask = self.grammars.masks(sub_rows)
        # the rows and their stop tokens in one copy
        at = to_device(structured + [min(r.stop_token_ids, default=0) for r in sub_rows],
                       logits.device)
        index, stops = at[:len(structured)], at[len(structured):]
        logits = logits if own else logits.clone()
        mask_logits_(logits, index, bitmask.to(logits.device, non_blocking=True), stops)
        return logits, index

    def _shape(self, logits: torch.Tensor, rows):
        """(logits with each row's own settings applied, (batch rows, slab rows) of the
        penalised rows or None). Untouched rows are the input's; the input is not changed
        (logprobs are of the raw logits)."""
        barred = [i for i, r in enumerate(rows) if r.sampling.min_tokens
                  and self._num_sampled.get(r.request_id, 0) < r.sampling.min_tokens]
        penalised = [i for i, r in enumerate(rows) if r.sampling.has_penalties]
        biased = [i for i, r in enumerate(rows) if r.sampling.logit_bias]
        if not (barred or penalised or biased):
            return logits, None
        device, vocab = logits.device, logits.shape[1]
        logits = logits.clone()
        counted = None
        if penalised:
            if self._counts is None:
                self._counts = TokenCounts(vocab, device)
            slab_rows = to_device([self._counts.row(rows[i].request_id, rows[i].prompt_token_ids)
                                   for i in penalised], device)
            index = to_device(penalised, device)
            sp = [rows[i].sampling for i in penalised]
            logits.index_copy_(0, index, apply_penalties(
                logits.index_select(0, index), self._counts.counts.index_select(0, slab_rows),
                self._counts.in_prompt.index_select(0, slab_rows),
                *(to_device([getattr(s, name) for s in sp], device, logits.dtype) for name in
                  ("repetition_penalty", "frequency_penalty", "presence_penalty"))))
            counted = (index, slab_rows)
        cells = [(i, t, b) for i in biased for t, b in rows[i].sampling.logit_bias]
        # min_tokens: the stop tokens (eos included) cannot be drawn before it is reached
        cells += [(i, t, float("-inf")) for i in barred for t in sorted(rows[i].stop_token_ids)
                  if t < vocab]
        if cells:
            add_at(logits, *map(list, zip(*cells)))
        return logits, counted

    def _next_draw(self, rid: str, sp: SamplingParams) -> tuple[int, int]:
        seed, n = self._draws.get(rid) or (
            signed64(sp.seed if sp.seed is not None else random.getrandbits(63)), 0)
        self._draws[rid] = (seed, n + 1)
        return seed, n

