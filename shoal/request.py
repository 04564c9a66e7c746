"""The records of a request's life: what enters an engine (`NewRequest`), its state inside
(`Request`), and what comes out (`RequestOutput`, and per step a `StepResult`). The same
records cross threads (the driver) and processes (a fleet's pipes)."""

from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass, field

from shoal.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted); holds no blocks
    WAITING_FOR_LOAD = "waiting_for_load"  # cancelled while its load is pending: out of the
    # running requests, its blocks held until the load drains (a loading request runs)
    RUNNING = "running"  # holds blocks, scheduled every step until finished
    SAVING = "saving"  # finished, an async save still reads its blocks
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float  # time.perf_counter() when the request entered the engine
    scheduled_time: float | None = None  # first admitted to a step (its queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class PoolHit:
    """How a request's pool hit was served (SPEC 3.1), for its output and stats."""

    decision: str  # "load": loaded, then computed on; "split": the front computed while the
    # back loaded; "compute": not loaded (computing it was the faster way)
    num_matched_tokens: int  # tokens the pool had after the local prefix hit
    num_front_tokens: int = 0  # of them computed by the engine (the front)
    num_loaded_tokens: int = 0  # of them loaded and used (the rest was recomputed)
    prefill_tokens_per_s: float = 0.0  # the rates the decision used (0: not measured yet)
    load_tokens_per_s: float = 0.0  # this hit's: the store's and host memory's, weighed
    load_latency_s: float = 0.0  # the expected wait for the load's first block
    num_host_tokens: int = 0  # of the matched tokens, expected from the worker's host memory


@dataclass
class Request:
    """Engine-side state of one request. Token ranges (block_size 4, prompt of 10):

        position   0 ........... 9 | 10 11 ...
        tokens     prompt           | outputs (+ in-flight samples in the overlap loop)
                   |-- computed --|--- scheduled this step ---|
                   ^ local prefix hits are always whole blocks and never the last prompt token
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) + sampling.stop_token_ids
    cache_salt: str | None = None
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is computed or scheduled in a step
    num_inflight_tokens: int = 0  # sampled by a step in flight, not yet appended
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the full blocks so far
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_local_prefix_tokens: int | None = None  # prefix hit at first admission
    num_connector_tokens: int = 0  # tokens loaded from the pool
    pool_hit: PoolHit | None = None  # how its pool hit was served (None: no hit)
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids are known (prompt + appended outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens that exist or will once the step in flight returns."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known token ids of positions [start, end) (positions past num_tokens are omitted)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # a decode step's slice: outputs only
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass(frozen=True)
class NewRequest:
    """A request as it enters an engine (or a fleet, which passes it to one rank)."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str | None = None  # None: the engine names it
    prompt: str | None = None  # the text, when the prompt was text
    cache_salt: str | None = None  # isolates its block keys from requests of other salts

    def __post_init__(self) -> None:
        """Types checked and token ids made plain ints (TypeError/ValueError naming the
        field); the vocabulary range is checked where it is known (`check_vocab`)."""
        object.__setattr__(self, "prompt_token_ids", token_id_list(self.prompt_token_ids))
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams, got "
                            f"{type(self.sampling).__name__}")
        if not isinstance(self.request_id, (str, type(None))) or self.request_id == "":
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        for name in ("prompt", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the first prompt token id, or logit_bias id, out of [0, vocab_size)."""
        ids = self.prompt_token_ids
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:  # (a long prompt: C speed)
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
            raise ValueError(f"prompt token id {t} (position {i}) is outside the model's "
                             f"vocabulary [0, {vocab_size})")
        for t, _ in self.sampling.logit_bias:
            if t >= vocab_size:
                raise ValueError(f"SamplingParams.logit_bias: token id {t} is outside the "
                                 f"model's vocabulary [0, {vocab_size})")

    def stop_ids(self, eos_token_ids, tokenizer) -> frozenset[int]:
        """The request's stop tokens (the model's `eos_token_ids` unless ignore_eos);
        ValueError for structured output that could never run (no `tokenizer`) or end (no
        stop token). Checked where requests arrive (an engine, a fleet's front), as check_vocab."""
        sampling = self.sampling
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        if sampling.structured_output is not None:
            if not tokenizer.is_available:
                raise ValueError("SamplingParams.structured_output needs the model's tokenizer "
                                 "(this checkpoint has none)")
            if not stop:
                raise ValueError("SamplingParams.structured_output needs a stop token to end "
                                 "with: the model's eos (ignore_eos=False) or stop_token_ids")
        return frozenset(stop)


def token_id_list(ids) -> list[int]:
    """A prompt given as token ids, as a list of ints: a list, tuple or range of Python or
    NumPy ints, or a 1-D NumPy/torch integer array. TypeError for anything else (text is
    tokenized before this; bytes are not token ids)."""
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:
        ids = ids.tolist()  # an array: its items as Python scalars
    if not isinstance(ids, (list, tuple, range)):
        raise TypeError("a prompt must be a str or a sequence of int token ids, got "
                        f"{type(ids).__name__}")
    if all(type(t) is int for t in ids):  # plain ints (the usual case): no ABC check each
        return list(ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt token ids must be ints, got {type(t).__name__} "
                            f"{t!r:.40} at position {i}")
    return [int(t) for t in ids]


@dataclass
class RequestOutput:
    """The final result of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated ids (a stop token is included)
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    error: str | None  # the message when finish_reason == "error"
    metrics: RequestMetrics
    num_local_prefix_tokens: int  # served from this rank's own prefix cache
    num_connector_tokens: int  # loaded from the pool through the connector
    logprobs: list | None = None  # one sampling.TokenLogprobs per token, if the request asked
    pool_hit: PoolHit | None = None  # how its pool hit was served (None: no pool hit)
    # if asked (sampling.prompt_logprobs): per prompt token its TokenLogprobs (None first)
    prompt_logprobs: list | None = None

    @classmethod
    def from_request(cls, req: Request, text: str = "") -> RequestOutput:
        """What a finished request hands back (`text` is filled where a tokenizer decodes)."""
        return cls(request_id=req.request_id, prompt=req.prompt,
                   prompt_token_ids=req.prompt_token_ids, text=text,
                   token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
                   error=req.error, metrics=req.metrics,
                   num_local_prefix_tokens=req.num_local_prefix_tokens or 0,
                   num_connector_tokens=req.num_connector_tokens, pool_hit=req.pool_hit)


@dataclass
class StepResult:
    """What one engine step (or a fleet's poll of its ranks) hands back."""

    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # rid -> ids since the last
    finished: list[RequestOutput] = field(default_factory=list)  # done: nothing of theirs pending
    new_logprobs: dict[str, list] = field(default_factory=dict)  # rid -> new_tokens' TokenLogprobs

    def __bool__(self) -> bool:
        return bool(self.new_tokens or self.finished)

    def merge(self, later: StepResult) -> StepResult:
        """This result followed by `later` (tokens in order, finished appended)."""
        for rid, ids in later.new_tokens.items():
            self.new_tokens.setdefault(rid, []).extend(ids)
        for rid, logprobs in later.new_logprobs.items():
            self.new_logprobs.setdefault(rid, []).extend(logprobs)
        self.finished += later.finished
        return self
