"""Requests in flight: `RequestHandle` (what `LLM.submit` returns) and the driver thread.

The engine (one rank, or the front of a fleet) is not thread-safe, so once the first
request is submitted every call to it runs on one background thread, the driver: it takes
queued operations (add, cancel, stats, ...) between steps, steps while there is work, and
after each step hands new tokens to streams and finished requests to their handles (an
engine returns a request once it ended and nothing of it is pending: a save of its blocks
still running keeps it, as `generate` returns only after its saves).
If the driver is stuck in a connector hook that never returns, the connector's watchdog
`abandon`s it: every handle and later call gets the ConnectorError, nothing waits for it.

A handle delivers its tokens either through `stream()` (a blocking iterator) or, after
`subscribe(callback)`, by calling the callback on the driver thread: an asyncio server
passes a callback that does `loop.call_soon_threadsafe(...)`, so no thread waits per stream.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Protocol

from shoal.engine.build import EngineInfo
from shoal.model.tokenizer import Tokenizer
from shoal.request import NewRequest, RequestOutput, StepResult

log = logging.getLogger(__name__)

# How often a main thread's untimed wait wakes to take a Ctrl-C. A process's SIGINT may be
# handed to any of its threads (Linux prefers the main thread, not always); Python runs the
# handler only on the main thread, between bytecodes, and a main thread blocked on a lock
# with no timeout is not woken for a signal another thread took: the Ctrl-C would wait
# until the request ended.
SIGNAL_POLL_SECONDS = 0.1


def _wakes_for_ctrl_c(timeout: float | None) -> bool:
    """An untimed wait on the main thread: it must wake every SIGNAL_POLL_SECONDS."""
    return timeout is None and threading.current_thread() is threading.main_thread()


def result_of(fut: Future, timeout: float | None = None):
    """`fut.result(timeout)`; on the main thread an untimed wait wakes every
    SIGNAL_POLL_SECONDS, so a Ctrl-C is raised here at once, whichever thread took it."""
    if not _wakes_for_ctrl_c(timeout):
        return fut.result(timeout)
    while True:
        try:
            return fut.result(SIGNAL_POLL_SECONDS)
        except TimeoutError:
            if fut.done():  # the future's own error
                raise


_END = object()  # a stream's last item


class EngineLike(Protocol):
    """What the driver thread runs: one rank's `Engine`, or a `Fleet` of rank processes."""

    tokenizer: Tokenizer
    info: EngineInfo

    @property
    def has_work(self) -> bool: ...
    def add(self, new: NewRequest) -> str: ...
    def cancel(self, request_id: str) -> None: ...
    def step(self) -> StepResult: ...
    def stats(self) -> dict: ...
    def check_integrity(self) -> None: ...
    def drain(self) -> StepResult: ...
    def shutdown(self) -> None: ...
    def wake(self) -> None: ...  # the driver queued work: a step waiting for ranks returns


def collect_what_was_shut_down() -> None:
    """After an engine shut down and was let go, when a reference cycle still holds it: its
    objects were frozen with the rest at its bring-up (shoal.util.freeze_what_was_built),
    out of the cyclic collector's reach, so the cycle would keep its weights and KV memory
    for the life of the process (on a GPU, each engine a process builds after another would
    add its own until one no longer fits). Collect once with everything thawed (~0.2-0.5
    s); freeze the survivors (other engines, the libraries) again. An engine no cycle holds
    is freed when let go."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class RequestHandle:
    """One submitted request."""

    def __init__(self, driver: Driver, request_id: str, streams: bool = True):
        self._driver = driver
        self.request_id = request_id
        # False: only the result is wanted (generate), the driver hands it no token batches
        self.streams = streams
        self._future: Future = Future()
        # (token_ids, logprobs) batches, then _END; a deque and a condition rather than a
        # queue.Queue: the driver pushes to every live request each step
        self._tokens: deque = deque()
        self._lock = threading.Condition(threading.Lock())  # the batches, and a subscriber taking over
        self._callback: Callable[[list[int] | None, list | None], None] | None = None

    def cancel(self) -> None:
        """End the request as "cancelled": at once, or (with a pending KV transfer) once the
        transfer drains, within the connector's control_grace_sec."""
        self._driver.run_soon(lambda engine: engine.cancel(self.request_id))

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output once the request ended; TimeoutError if it has not within `timeout`
        seconds; the engine's error if the engine stopped (e.g. a fatal connector failure)."""
        return result_of(self._future, timeout)

    def stream(self) -> Iterator[int]:
        """Generated token ids as they are produced (each once), ending with the request."""
        self._check_streams()  # here, not at the first next()
        return self._stream()

    def _stream(self) -> Iterator[int]:
        wait = SIGNAL_POLL_SECONDS if _wakes_for_ctrl_c(None) else None
        while True:
            with self._lock:
                while not self._tokens:
                    self._lock.wait(wait)
                item = self._tokens.popleft()
            if item is _END:
                self._future.result()  # raise the engine's error, if that is how it ended
                return
            yield from item[0]

    def subscribe(self, callback: Callable[[list[int] | None, list | None], None]) -> None:
        """Deliver this request's tokens to `callback(token_ids, logprobs)` instead of
        `stream()`: once per batch of new tokens (`logprobs`: one `TokenLogprobs` per token
        when the request asked for them, else None), then `callback(None, None)` once the
        request ended (`result()` returns at once from then on). Batches produced before
        the call are delivered here, at once; later ones on the driver thread, so the
        callback must be quick and thread-safe (e.g. `loop.call_soon_threadsafe`). An
        exception it raises is logged and never reaches the engine."""
        self._check_streams()
        with self._lock:
            while self._tokens:
                item = self._tokens.popleft()
                _call(callback, *((None, None) if item is _END else item))
            self._callback = callback

    def _check_streams(self) -> None:
        if not self.streams:
            raise RuntimeError(f"request {self.request_id} was submitted without streaming: "
                               "only its result() is kept")

    def _push(self, token_ids: list[int], logprobs: list | None = None) -> None:
        with self._lock:
            if self._callback is not None:
                _call(self._callback, token_ids, logprobs)
            else:
                self._tokens.append((token_ids, logprobs))
                self._lock.notify()  # no-op unless a stream() waits

    def _end(self) -> None:
        if not self.streams:
            return  # nobody reads its batches: result() is all
        with self._lock:
            if self._callback is not None:
                _call(self._callback, None, None)
            else:
                self._tokens.append(_END)
                self._lock.notify()

    def _finish(self, output: RequestOutput) -> None:
        self._future.set_result(output)  # first: a subscriber reads result() when told
        self._end()

    def _fail(self, error: BaseException) -> None:
        self._future.set_exception(error)
        self._end()


def _call(callback: Callable, *args) -> None:
    """A subscriber's callback; its failure is its own (logged), never the driver's."""
    try:
        callback(*args)
    except Exception:
        log.exception("a request's token callback failed")


class Driver:
    """Runs the engine on a background thread (started by the first `start`).
    `complete(output)` fills what the engine leaves to the front (the decoded text)."""

    def __init__(self, engine: EngineLike, complete: Callable[[RequestOutput], RequestOutput]):
        self.engine = engine
        self._complete = complete
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # (fn(engine), future)
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._lock = threading.RLock()  # handles: the driver's, or abandon's from a watchdog
        # set while the engine has no work and no operation is queued (or once it stopped)
        self._idle = threading.Event()
        self._idle_lock = threading.Lock()  # queueing an op vs the loop finding none queued

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shoal-driver", daemon=True)
            self._thread.start()

    def call(self, fn: Callable):
        """fn(engine) on the driver thread (or here, before it started); returns its result."""
        if self._thread is None:
            self._raise_if_failed()
            return fn(self.engine)
        return result_of(self.run_soon(fn))

    def run_soon(self, fn: Callable) -> Future:
        fut: Future = Future()
        self._raise_if_failed()
        with self._idle_lock:
            self._idle.clear()  # fn may add work
            self._ops.put((fn, fut))
        self._wake.set()
        engine = self.engine  # (None once stopped: the future fails below)
        if engine is not None:
            engine.wake()  # a step waiting for a fleet's ranks returns
        if self._error is not None:  # the driver failed meanwhile: nobody runs it
            self._run_ops(self._error)
            self._idle.set()
        return fut

    def submit(self, requests: list[NewRequest], streams: bool = True) -> list[RequestHandle]:
        """Add the requests on the driver thread, all before the next step; the handles come
        back at once (an invalid request id raises here). `streams=False`: only the results
        are wanted, so no step hands these handles their new tokens (per-request work on
        the driver thread at every step, for batches of hundreds)."""
        self.start()
        return result_of(self.run_soon(lambda engine: self._add_all(engine, requests, streams)))

    def stop(self) -> None:
        """Drain and shut the engine down as the driver's last operation; end the thread;
        let the engine go (its weights and KV memory are freed here). Handles of requests
        cancelled by the drain get their outputs; any left (a fleet stops its ranks itself)
        get an error."""
        try:
            if self._thread is None or self._error is not None:
                self._stopped = True
                self._last(self.engine)
                return
            fut = self.run_soon(self._last)
            self._stopped = True
            self._wake.set()
            try:
                fut.result()
            finally:
                self._thread.join()
        finally:  # its memory goes back now, not at the process's exit
            engine, self.engine = weakref.ref(self.engine), None
            if engine() is not None:  # held by a cycle: out of the collector's reach
                collect_what_was_shut_down()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the engine has no work: every request ended and was handed back (its
        KV blocks freed, its saves reported) and no operation is queued. False if `timeout`
        seconds passed first; the engine's error if it stopped for good. A later submit
        makes it busy again."""
        if self._thread is None:
            self._raise_if_failed()
            return not self.engine.has_work
        if _wakes_for_ctrl_c(timeout):
            while not self._idle.wait(SIGNAL_POLL_SECONDS):  # as result_of: takes a Ctrl-C
                pass
            is_idle = True
        else:
            is_idle = self._idle.wait(timeout)
        self._raise_if_failed()
        return is_idle

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped for good (a fatal failure), or None while it runs."""
        return self._error

    def abandon(self, error: BaseException) -> None:
        """The driver thread is stuck (in a connector hook): fail every handle and every
        later call with `error` from here; stop() then waits for nothing."""
        self._fail_all(error)
        self._wake.set()

    def _last(self, engine: EngineLike) -> None:
        try:
            if self._error is None:
                self._publish(engine.drain())
        finally:
            engine.shutdown()
            self._fail_all(RuntimeError("the LLM was shut down before this request ended"),
                           keep_error=self._error is not None)

    # -- the driver thread -------------------------------------------------------------

    def _add_all(self, engine: EngineLike, requests: list[NewRequest],
                 streams: bool) -> list[RequestHandle]:
        """All or nothing: if one is refused, those added before it are cancelled."""
        handles = []
        try:
            for r in requests:
                handles.append(self._track(engine.add(r), streams))
        except BaseException:
            for h in handles:  # their handles end unseen, as "cancelled"
                engine.cancel(h.request_id)
            raise
        return handles

    def _track(self, request_id: str, streams: bool) -> RequestHandle:
        handle = RequestHandle(self, request_id, streams)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._handles[request_id] = handle
        return handle

    def _loop(self) -> None:
        while True:
            self._run_ops()
            if self._stopped:
                self._run_ops()
                return
            if not self.engine.has_work:
                with self._idle_lock:
                    if self._ops.empty():
                        self._idle.set()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                finished = self.engine.step()
            except BaseException as e:  # the engine is unusable: every handle learns why
                self._fail_all(e)
                return
            self._publish(finished)

    def _run_ops(self, error: BaseException | None = None) -> None:
        """Run the queued operations (or, once the engine failed, fail them with `error`)."""
        while True:
            try:
                fn, fut = self._ops.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            if error is not None:
                fut.set_exception(error)
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _publish(self, result: StepResult) -> None:
        with self._lock:
            if self._error is not None:
                return
            for rid, token_ids in result.new_tokens.items():
                handle = self._handles.get(rid)
                if handle is not None and handle.streams:
                    handle._push(token_ids, result.new_logprobs.get(rid))  # a fresh list
            for out in result.finished:
                handle = self._handles.pop(out.request_id, None)
                if handle is None:  # the engine returns a request once: it was not added here
                    log.warning("request %s was added to the engine directly, not through "
                                "submit: its output is dropped", out.request_id)
                    continue
                handle._finish(self._complete(out))

    def _fail_all(self, error: BaseException, keep_error: bool = False) -> None:
        with self._lock:
            if not keep_error and self._error is None:
                self._error = error
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            handle._fail(error)
        self._run_ops(error)
        self._idle.set()  # nothing runs any more: wait_idle returns (or raises the error)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
