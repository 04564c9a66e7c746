"""Clients that stall while sending a request lose the connection (`--read-timeout`).

uvicorn times out idle keep-alive connections but not a request that is never finished:
a client that sends half its headers, or a body slower than nothing at all, holds a
connection (and a file descriptor) for as long as it likes. `ReadTimeoutProtocol` is
uvicorn's h11 protocol with one more timer: while the client owes bytes of a request
(headers not complete, or the body not complete) and sends none for the timeout, the
server answers 408 in OpenAI's error shape (unless a response has started) and closes
the connection. A client waiting for a long answer owes nothing and is never cut.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from shoal.serving.errors import ApiError

DEFAULT_READ_TIMEOUT_S = 30.0


class ReadTimeoutProtocol(H11Protocol):
    """Reads the timeout from the uvicorn config's `shoal_read_timeout_s` (None: off)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self._read_timeout_s = getattr(config, "shoal_read_timeout_s", None)
        self._last_read = 0.0
        self._read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._last_read = self.loop.time()
        self._arm(self._last_read)

    def data_received(self, data: bytes) -> None:
        self._last_read = self.loop.time()
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        super().connection_lost(exc)

    def _arm(self, since: float) -> None:
        if self._read_timeout_s is not None:
            self._read_timer = self.loop.call_at(since + self._read_timeout_s, self._check)

    def _owes_bytes(self) -> bool:
        """The client is in the middle of a request: headers or body not all received
        (IDLE also covers a new connection, or a keep-alive one, that sent nothing)."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _check(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if not self._owes_bytes():
            self._arm(now)  # answering it: look again later
        elif now - self._last_read < self._read_timeout_s:
            self._arm(self._last_read)
        else:
            self._time_out()

    def _time_out(self) -> None:
        if self.cycle is None or not self.cycle.response_started:
            body = json.dumps(ApiError(
                408, f"the request was not received in full: no data for "
                f"{self._read_timeout_s:g} s (--read-timeout)", type_="timeout_error").body())
            head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + body.encode())
        self.transport.close()
