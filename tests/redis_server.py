"""Real redis-server processes for the redis pool's tests (no mock, no fake Redis).

`.ci/run` starts one server on loopback and exports SHOAL_TEST_REDIS_URL; tests that share
it flush their database first. Tests that stop, restart or configure a server (a password,
maxmemory, a cluster, TLS) start their own here, on a free loopback port with a
temporary directory, and stop it by pid. Where neither redis-server nor valkey-server can
be found, the tests that need one skip, saying so.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 20.0


def server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("valkey-server")


def require_redis() -> str:
    """The server binary, or skip: the redis pool's tests need a real server."""
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("the redis package is not installed (pip install -e '.[test]')")
    binary = server_binary()
    if binary is None:
        pytest.skip("redis-server (or valkey-server) is not installed: apt-get install redis-server")
    return binary


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port; with `cluster_bus`, one whose cluster bus port (+10000) is
    free too (and so below 55536)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass


class RedisServer:
    """One redis-server on 127.0.0.1, started with `args` (e.g. ["--requirepass", "x"])."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None):
        self.binary = require_redis()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.workdir)
        self.wait_ready()

    def wait_ready(self) -> None:
        """Until the server logs that it accepts connections (its log goes to a pipe read
        here, then drained on a thread so that the server never blocks on it)."""
        self._lines: queue.Queue[bytes | None] = queue.Queue()

        def drain(out) -> None:
            for line in out:
                self._lines.put(line)
            self._lines.put(None)  # the server exited
        threading.Thread(target=drain, args=(self.proc.stdout,), daemon=True).start()
        self.wait_for_log(b"Ready to accept connections", START_TIMEOUT_S)

    def wait_for_log(self, text: bytes, timeout: float) -> None:
        """Until the server logs a line holding `text` (after the lines read before)."""
        deadline = time.monotonic() + timeout
        log = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"redis-server exited with {self.proc.wait()}: "
                                   f"{b''.join(log).decode(errors='replace')}")
            log.append(line)
            if text in line:
                return
        raise RuntimeError(f"redis-server on port {self.port} never logged {text!r}")

    def client(self, db: int = 0, **kw):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, db=db, **kw)

    def kill(self) -> None:
        """SIGKILL, by pid: as a crash, nothing flushed or said goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def shared_url() -> str | None:
    """The server `.ci/run` started, if any."""
    return os.environ.get("SHOAL_TEST_REDIS_URL") or None
