"""HookWatchdog: notices a connector hook call that blocks instead of returning.

Deadlines (SPEC 6) cover transfers the connector reports as pending; they cannot cover a
hook that never returns, because the engine thread that would check them is the one
stuck inside it. The watchdog is a thread of its own: every hook call is entered and left
here, and a call still running `limit` seconds after it started is reported, once, to
`on_stuck(hook)`. The stuck call itself cannot be interrupted; what to do about it is the
caller's policy (KVTransfers: fatal).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable


class HookWatchdog:
    def __init__(self, limit: float, on_stuck: Callable[[str], None]):
        self.limit = limit
        self._on_stuck = on_stuck
        self._calls: dict[int, tuple[str, float]] = {}  # token -> (hook, started)
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, hook: str) -> int:
        """A hook call starts; pass the token to `leave` when it returns."""
        token = next(self._tokens)
        with self._lock:
            self._calls[token] = (hook, time.monotonic())
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._watch, name="shoal-hook-watchdog",
                                                daemon=True)
                self._thread.start()
        return token

    def leave(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        # a stuck call is seen at most a quarter of the limit (or a second) late
        period = min(self.limit / 4, 1.0)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                stuck = [hook for hook, started in self._calls.values()
                         if now - started > self.limit]
            if stuck:
                self._stop.set()  # reported once: the connector is not called again
                self._on_stuck(stuck[0])
