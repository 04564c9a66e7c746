"""Requests in flight: `RequestHandle` (what `LLM.submit` returns) and the driver thread.

The engine (one rank, or the front of a fleet) is not thread-safe, so once the first
request is submitted every call to it runs on one background thread, the driver: it takes
queued operations (add, cancel, stats, ...) between steps, steps while there is work, and
after each step hands new tokens to streams and finished requests to their handles. A
handle is done once its request has ended and nothing of it is pending (a save of its
blocks still running keeps it open, as `generate` returns only after its saves).
If the driver is stuck in a connector hook that never returns, the connector's watchdog
`abandon`s it: every handle and later call gets the ConnectorError, nothing waits for it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from shoal.request import Request, RequestOutput, RequestStatus

log = logging.getLogger(__name__)

_END = object()  # a stream's last item


class RequestHandle:
    """One submitted request."""

    def __init__(self, driver: Driver, request_id: str):
        self._driver = driver
        self.request_id = request_id
        self._future: Future = Future()
        self._tokens: queue.Queue = queue.Queue()

    def cancel(self) -> None:
        """End the request as "cancelled": at once, or (with a pending KV transfer) once the
        transfer drains, within the connector's control_grace_sec."""
        self._driver.run_soon(lambda engine: engine.cancel(self.request_id))

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output once the request ended; TimeoutError if it has not within `timeout`
        seconds; the engine's error if the engine stopped (e.g. a fatal connector failure)."""
        return self._future.result(timeout)

    def stream(self) -> Iterator[int]:
        """Generated token ids as they are produced (each once), ending with the request."""
        while True:
            item = self._tokens.get()
            if item is _END:
                self._future.result()  # raise the engine's error, if that is how it ended
                return
            yield from item


class Driver:
    """Runs the engine on a background thread (started by the first `start`)."""

    def __init__(self, engine, to_output: Callable[[Request], RequestOutput]):
        self.engine = engine
        self._to_output = to_output
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # (fn(engine), future)
        self._wake = threading.Event()
        self._handles: dict[str, tuple[RequestHandle, Request]] = {}
        self._sent: dict[str, int] = {}  # rid -> tokens streamed
        self._ended: list[tuple[RequestHandle, Request]] = []  # ended, a save still pending
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._lock = threading.RLock()  # handles: the driver's, or abandon's from a watchdog

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shoal-driver", daemon=True)
            self._thread.start()

    def call(self, fn: Callable):
        """fn(engine) on the driver thread (or here, before it started); returns its result."""
        if self._thread is None:
            self._raise_if_failed()
            return fn(self.engine)
        return self.run_soon(fn).result()

    def run_soon(self, fn: Callable) -> Future:
        fut: Future = Future()
        self._raise_if_failed()
        self._ops.put((fn, fut))
        self._wake.set()
        if self._error is not None:  # the driver failed meanwhile: nobody runs it
            self._run_ops(self._error)
        return fut

    def submit(self, adds: list[Callable]) -> list[RequestHandle]:
        """Each add(engine) -> Request runs on the driver thread, all before the next step;
        the handles come back at once (an invalid request id raises here)."""
        self.start()
        return self.run_soon(lambda engine: [self._track(add(engine)) for add in adds]).result()

    def stop(self) -> None:
        """Drain and shut the engine down as the driver's last operation; end the thread.
        Handles of requests cancelled by the drain get their outputs; any left (a fleet
        stops its ranks itself) get an error."""
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

    def abandon(self, error: BaseException) -> None:
        """The driver thread is stuck (in a connector hook): fail every handle and every
        later call with `error` from here; stop() then waits for nothing."""
        self._fail_all(error)
        self._wake.set()

    def _last(self, engine) -> None:
        try:
            drain = getattr(engine, "drain", None)
            if drain is not None and self._error is None:
                self._publish(drain())
        finally:
            engine.shutdown()
            self._fail_all(RuntimeError("the LLM was shut down before this request ended"),
                           keep_error=self._error is not None)

    # -- the driver thread -------------------------------------------------------------

    def _track(self, req: Request) -> RequestHandle:
        handle = RequestHandle(self, req.request_id)
        with self._lock:
            if self._error is not None:
                raise self._error
            self._handles[req.request_id] = (handle, req)
        return handle

    def _loop(self) -> None:
        while True:
            self._run_ops()
            if self._stopped:
                self._run_ops()
                return
            if not self.engine.has_work and not self._ended:
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

    def _publish(self, finished: list[Request]) -> None:
        with self._lock:
            if self._error is None:
                self._publish_locked(finished)

    def _publish_locked(self, finished: list[Request]) -> None:
        for rid, req in self.engine.live_requests().items():
            self._stream(rid, req)
        for req in finished:
            if req.request_id not in self._handles:
                log.error("request %s ended twice", req.request_id)
                continue
            self._stream(req.request_id, req)
            self._ended.append(self._handles.pop(req.request_id))
        still = []
        for handle, req in self._ended:
            if req.status == RequestStatus.SAVING:
                still.append((handle, req))
                continue
            self._sent.pop(handle.request_id, None)
            handle._tokens.put(_END)
            handle._future.set_result(self._to_output(req))
        self._ended = still

    def _stream(self, rid: str, req: Request) -> None:
        entry = self._handles.get(rid)
        n = self._sent.get(rid, 0)
        if entry is not None and len(req.output_token_ids) > n:
            self._sent[rid] = len(req.output_token_ids)
            entry[0]._tokens.put(list(req.output_token_ids[n:]))

    def _fail_all(self, error: BaseException, keep_error: bool = False) -> None:
        with self._lock:
            if not keep_error and self._error is None:
                self._error = error
            entries = [*self._handles.values(), *self._ended]
            self._handles.clear()
            self._ended = []
        for handle, _ in entries:
            handle._tokens.put(_END)
            handle._future.set_exception(error)
        self._run_ops(error)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
