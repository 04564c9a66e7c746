"""A request's life inside the engine, and the output handed back to the user."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shoal.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted); holds no blocks
    WAITING_FOR_LOAD = "waiting_for_load"  # blocks allocated, an async pool load fills them
    RUNNING = "running"  # holds blocks, scheduled every step until finished
    SAVING = "saving"  # finished, an async save still reads its blocks
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float  # time.perf_counter() when the request entered the engine
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
        return self.num_tokens + self.num_inflight_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known token ids of positions [start, end) (positions past num_tokens are omitted)."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids[start:] if start < n else []) + \
            self.output_token_ids[max(start - n, 0):end - n]


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
