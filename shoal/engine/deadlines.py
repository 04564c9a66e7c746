"""When each request's pending KV transfers must be done (SPEC 6): set when the first of
them is pending, never extended; a cancel or a shutdown shortens it to the grace."""

from __future__ import annotations

import math
import time


class Deadlines:
    def __init__(self, timeout_s: float, grace_s: float):
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self._at: dict[str, float] = {}  # rid -> monotonic deadline of its pending transfers

    def start(self, request_id: str) -> None:
        """A transfer of the request is pending from now (an earlier deadline stands)."""
        self._at.setdefault(request_id, time.monotonic() + self.timeout_s)

    def end(self, request_id: str) -> None:
        """None of the request's transfers is pending any more."""
        self._at.pop(request_id, None)

    def shorten(self, request_id: str) -> None:
        """A cancel or shutdown: the request's pending transfers get at most the grace."""
        if request_id in self._at:
            self._at[request_id] = min(self._at[request_id], time.monotonic() + self.grace_s)

    def shorten_all(self) -> None:
        for request_id in list(self._at):
            self.shorten(request_id)

    def of(self, request_ids) -> dict[str, float]:
        """The deadlines of these requests (inf: none)."""
        return {rid: self._at.get(rid, math.inf) for rid in request_ids}
