"""The server's limits (`shoal serve` flags), validated once at bring-up."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.serving.body_limit import DEFAULT_MAX_BODY_BYTES
from shoal.serving.read_timeout import DEFAULT_READ_TIMEOUT_S


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies: 413 before parsing
    # generation requests taken at once (a place is held until the engine ended every
    # choice); None: the engine's batch (max_batch_size x data-parallel ranks)
    max_concurrent_requests: int | None = None
    max_queue: int | None = None  # waiting for a place at most; past it 429 (None: as many as run)
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S  # a stalled request's client is cut (None: never)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent_requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_queue is not None and (isinstance(self.max_queue, bool)
                                           or not isinstance(self.max_queue, int)
                                           or self.max_queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if self.read_timeout_s is not None and not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0 (or None: off), got "
                             f"{self.read_timeout_s!r}")

    def places(self, engine_batch: int) -> tuple[int, int]:
        """(max concurrent, max queue) with the defaults filled in for an engine whose
        steps take `engine_batch` requests."""
        running = self.max_concurrent_requests or engine_batch
        return running, running if self.max_queue is None else self.max_queue
