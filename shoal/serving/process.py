"""The `shoal serve` process: the listening socket, uvicorn with the read timeout, and a
SIGTERM/SIGINT that drains (`OpenAIServer.drain`) and returns normally."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading

import uvicorn

from shoal.llm import LLM
from shoal.serving.app import build_app
from shoal.serving.http import ABORT_WAIT_S, OpenAIServer
from shoal.serving.limits import ServerLimits
from shoal.serving.read_timeout import ReadTimeoutProtocol

# the line on stderr once listening: "shoal serve: ready on http://HOST:PORT (model NAME)"
READY_MESSAGE = "shoal serve: ready on"


def runs_engine_process(flag: bool | None, device: str) -> bool:
    """Whether `shoal serve` runs its engine in a process of its own: as --engine-process or
    --no-engine-process say (`flag`), else on a CUDA device (on an H100 the server's TPOT
    went from 1.56x the library's in process to 0.78-1.13x; docs/benchmarks.md)."""
    return device.startswith("cuda") if flag is None else flag


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for `serve` (bound before the model loads, so an address
    in use or unknown fails at once: OSError naming it). Made as a TCP socket by name:
    asyncio turns Nagle's algorithm off only on connections accepted from one (proto 0 kept
    it on, and each request of a kept-alive client waited ~40 ms for a delayed ACK)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def serve(llm: LLM, sock: socket.socket, served_model_name: str,
          shutdown_grace_sec: float, access_log: bool = False,
          api_key: str | None = None, limits: ServerLimits = ServerLimits()) -> None:
    """Serve on `sock` (from `listen`) until SIGTERM/SIGINT; then stop accepting, give
    running requests `shutdown_grace_sec` to finish (cancel the rest) and return. The
    caller shuts the LLM down. `api_key`: see build_app."""
    server = OpenAIServer(llm, served_model_name, limits)
    # uvicorn's own grace only lets the responses `drain` ended finish writing
    config = uvicorn.Config(build_app(server, api_key), lifespan="off", http=ReadTimeoutProtocol,
                            log_level="info" if access_log else "warning",
                            access_log=access_log, timeout_graceful_shutdown=ABORT_WAIT_S)
    config.shoal_read_timeout_s = limits.read_timeout_s
    try:
        _Server(config, server, shutdown_grace_sec).run(sockets=[sock])
    finally:
        server.close()
        sock.close()


class _Server(uvicorn.Server):
    """uvicorn's server whose SIGTERM/SIGINT end in a normal return (uvicorn re-raises
    the signal after its graceful shutdown, which would end the process by that signal
    before the engine is shut down, and with its exit status)."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer, grace_s: float):
        super().__init__(config)
        self._openai = server
        self._grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:  # a second SIGINT skips the grace
            await self._openai.drain(self._grace_s)
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # listening: requests are accepted from now on
            host, port = sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(f"{READY_MESSAGE} http://{host}:{port} (model {self._openai.model_name})",
                  file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        def on_signal(sig, frame):
            self._openai.is_stopping = True  # /health says so; new requests get 503
            self.handle_exit(sig, frame)
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
