"""One HTTP request's choices on the server's event loop.

Each choice is one engine request (`LLM.submit`). Its handle's callback runs on the driver
thread and only hands the batch of new tokens to the loop through the server's
`TokenInbox` (into one `asyncio.Queue` per HTTP request; the loop is woken once per engine
step, not once per request), so no thread waits per stream and the loop never waits for
the engine. On the loop, each choice's tokens go through a `TextStream` (text deltas,
stop strings); a choice that hits a stop string is cancelled in the engine. Leaving
`Generation.deltas()` early (the client went away, the server stops) cancels every choice
that has not ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shoal.request import RequestOutput
from shoal.sampling import TokenLogprobs
from shoal.serving.detokenizer import TextStream
from shoal.driver import RequestHandle
from shoal.serving.metrics import ServerMetrics
from shoal.serving.errors import ApiError
from shoal.serving.openai_protocol import Usage

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The engine failed for good (a fatal connector failure, a dead rank): 503."""


@dataclass
class Choice:
    """One choice of a response (one engine request)."""

    index: int  # the choice's index in the response (prompt_index * n + j)
    prompt_index: int  # which prompt of the request it continues
    prompt_ids: list[int]
    handle: RequestHandle
    text: TextStream
    arrival: float  # time.perf_counter() when the HTTP request arrived
    first_token_time: float | None = None
    last_token_time: float | None = None
    output: RequestOutput | None = None  # the engine's, once the request ended
    finish_reason: str | None = None  # the response's: a stop string makes it "stop"
    cancel_sent: bool = False
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)  # (id, its logprobs)

    @property
    def is_done(self) -> bool:
        return self.output is not None

    def cancel(self) -> None:
        if not self.cancel_sent and not self.is_done:
            self.cancel_sent = True
            try:
                self.handle.cancel()
            except Exception as e:  # the engine is gone: nothing left to cancel
                log.debug("cancel of %s: %s", self.handle.request_id, e)


@dataclass
class Delta:
    """What one choice adds to the response at one point."""

    choice: Choice
    text: str
    logprobs: list[tuple[int, TokenLogprobs]]  # of the tokens behind `text`
    finish_reason: str | None  # set once: the choice ended


class Generation:
    """The choices of one HTTP request, fed through `queue` by their handles' callbacks."""

    def __init__(self, choices: list[Choice], queue: asyncio.Queue, metrics: ServerMetrics):
        self.choices = choices
        self.queue = queue
        self.metrics = metrics

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas as tokens arrive, then one final Delta per choice. Raises ApiError
        (a request that failed) or EngineStopped. Closing it early cancels the rest. What
        is queued at once (the loop or the client fell behind the engine: several steps'
        tokens) makes one delta per choice, so a server behind does less work per token,
        not more (a chunk per token costs ~70 us of Python: JSON, SSE, the transport)."""
        remaining = len(self.choices)
        try:
            while remaining:
                items = [await self.queue.get()]
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                pending: dict[int, list] = {}  # choice index -> logprob entries not sent
                for index, token_ids, logprobs, when in items:
                    if index is not ABORTED and token_ids is not None:
                        pending.setdefault(index, []).extend(
                            self._add(self.choices[index], token_ids, logprobs, when))
                        continue
                    # an end or an error: the text before it goes first (an end may raise)
                    for delta in self._deltas(pending):
                        yield delta
                    if index is ABORTED:
                        raise token_ids  # the server stops: ApiError(503)
                    remaining -= 1
                    yield self._end(self.choices[index], when)
                for delta in self._deltas(pending):
                    yield delta
        finally:
            for choice in self.choices:
                choice.cancel()

    def _deltas(self, pending: dict[int, list]) -> list[Delta]:
        """Each pending choice's text that may be sent now, with the logprobs of its tokens
        (`pending`: choice index -> those logprobs; emptied)."""
        deltas = []
        for index, entries in pending.items():
            text = self.choices[index].text.take()
            if text or entries:
                deltas.append(Delta(self.choices[index], text, entries, None))
        pending.clear()
        return deltas

    def usage(self) -> Usage:
        """Prompts counted once (their first choice's cache hits), every choice's tokens."""
        firsts = {}
        for c in self.choices:
            firsts.setdefault(c.prompt_index, c)
        outs = [c.output for c in firsts.values() if c.output is not None]
        return Usage(prompt_tokens=sum(len(c.prompt_ids) for c in firsts.values()),
                     completion_tokens=sum(c.text.num_tokens for c in self.choices),
                     local_prefix_tokens=sum(o.num_local_prefix_tokens for o in outs),
                     pool_tokens=sum(o.num_connector_tokens for o in outs))

    def _add(self, choice: Choice, token_ids: list[int], logprobs: list | None,
             when: float) -> list[tuple[int, TokenLogprobs]]:
        if choice.text.stopped:
            return []  # tokens of the steps that ran before the cancel took effect
        if choice.first_token_time is None:
            choice.first_token_time = when
            self.metrics.observe_first_token(when - choice.arrival)
            if len(token_ids) > 1:
                self.metrics.observe_inter_token(0.0, len(token_ids) - 1)
        else:
            self.metrics.observe_inter_token(when - choice.last_token_time, len(token_ids))
        choice.last_token_time = when
        entries = []
        for i, token_id in enumerate(token_ids):
            before = choice.text.num_tokens
            choice.text.add(token_id)
            if logprobs is not None and choice.text.num_tokens > before:
                entries.append((token_id, logprobs[i]))
        choice.logprobs += entries
        if choice.text.stopped:
            choice.cancel()  # the engine's "cancelled" ending becomes "stop"
        return entries

    def _end(self, choice: Choice, when: float) -> Delta:
        try:
            out = choice.handle.result(timeout=0)  # set before the end was signalled
        except Exception as e:  # the engine stopped (the handle's error says why)
            raise EngineStopped(str(e)) from e
        choice.output = out
        if out.finish_reason == "error":
            raise ApiError(500, f"the request failed: {out.error}", type_="server_error")
        choice.finish_reason = "stop" if choice.text.stopped else out.finish_reason
        self.metrics.observe_finished(choice.finish_reason, when - choice.arrival)
        self.metrics.observe_phases(choice.arrival, out.metrics)
        return Delta(choice, choice.text.finish(), [], choice.finish_reason)


ABORTED = object()  # a ChoiceQueue item's index: the response ends with the item's error


class ChoiceQueue(asyncio.Queue):
    """One HTTP request's queue of (index, token_ids, logprobs, time) items, which also
    counts its choices' ends (token_ids None): `on_all_ended(n, callback)` calls back once
    n choices have ended, whether or not anyone still reads the queue (a client that left)."""

    def __init__(self) -> None:
        super().__init__()
        self._num_ended = 0
        self._expected = 0
        self._on_all_ended = None

    def put_nowait(self, item) -> None:
        super().put_nowait(item)
        if item[1] is None:
            self._num_ended += 1
            self._check_ended()

    def abort(self, error: BaseException) -> None:
        """The reader's `Generation.deltas()` raises `error` (and cancels the choices)."""
        super().put_nowait((ABORTED, error, None, time.perf_counter()))

    def on_all_ended(self, num_choices: int, callback) -> None:
        self._expected, self._on_all_ended = num_choices, callback
        self._check_ended()

    def _check_ended(self) -> None:
        if self._on_all_ended is not None and self._num_ended >= self._expected:
            callback, self._on_all_ended = self._on_all_ended, None
            callback()


class TokenInbox:
    """The driver thread -> event loop hand-off. Handles' callbacks append under a lock; the
    first item of a batch schedules one drain on the loop (`call_soon_threadsafe`), which
    moves every item to its request's queue. So the loop wakes once per engine step however
    many streams it feeds (each wake-up costs the engine's threads the GIL and a core)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, tuple]] = []

    def callback(self, queue: asyncio.Queue, index: int):
        """A handle's callback: (index, token_ids, logprobs, time) into `queue`, and
        (index, None, None, time) once the request ended."""
        def on_tokens(token_ids, logprobs) -> None:
            item = (index, token_ids, logprobs, time.perf_counter())
            with self._lock:
                self._items.append((queue, item))
                is_first = len(self._items) == 1
            if is_first:
                try:
                    self._loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the loop is closed: the server is gone
                    pass
        return on_tokens

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)
