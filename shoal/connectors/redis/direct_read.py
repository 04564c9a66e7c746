"""Reading one value off the socket straight into the memory it is for.

Through the client a GET of a 720 KiB block costs a fresh bytes object (mapped, touched,
freed) and then a copy into the KV cache; with these two gone a load runs at the rate of
the socket. `read_value_into` sends the command on a connection of the client's pool and
reads the reply (`$<length>\\r\\n<bytes>\\r\\n`, a nil (`$-1` in RESP2, `_` in RESP3), or `-<error>`)
with `recv_into` into the caller's buffers. One server (not a cluster: its replies may be
redirects); a connection whose reply is not read to its end is closed, never reused.
"""

from __future__ import annotations

LINE_BYTES = 64  # read for a reply's first line ("$" and a length; an error may be longer)
LINE_MAX = 1 << 16


def read_value_into(client, args: tuple, views: list[memoryview]) -> int | None:
    """Send `args` (a command replying with one bulk string), and read the value into
    `views` one after the other if its length is their total. Returns the value's
    length (the views hold it only if it equals their total), or None for a nil
    reply. Raises the client's ResponseError for an error reply, OSError (ConnectionError,
    a socket timeout) or the client's ConnectionError if the connection fails."""
    import redis
    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_command(*args)
        sock = conn._sock
        head, n = _recv_line(sock)
        end = head.index(b"\r\n")
        line, extra = bytes(head[:end]), memoryview(head)[end + 2:n]
        if line.startswith(b"-"):
            clean = len(extra) == 0
            raise redis.exceptions.ResponseError(line[1:].decode("utf-8", "replace"))
        if line == b"_":  # RESP3's nil
            clean = len(extra) == 0
            return None
        if not line.startswith(b"$"):
            raise redis.exceptions.ConnectionError(f"unexpected reply {line[:20]!r}")
        length = int(line[1:])
        if length < 0:
            clean = len(extra) == 0
            return None
        if length != sum(v.nbytes for v in views):
            return length  # not ours to read: the connection is closed (not clean)
        _fill(sock, [*views, memoryview(bytearray(2))], extra)
        clean = True
        return length
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


def _recv_line(sock) -> tuple[bytearray, int]:
    """Receive until a CRLF: (the buffer, the bytes received, possibly past the line)."""
    buf, n = bytearray(LINE_BYTES), 0
    while b"\r\n" not in buf[:n]:
        if n == len(buf):
            if n >= LINE_MAX:
                raise ConnectionError("reply line too long")
            buf.extend(bytes(n))
        got = sock.recv_into(memoryview(buf)[n:])
        if got == 0:
            raise ConnectionError("the store closed the connection")
        n += got
    return buf, n


def _fill(sock, views: list[memoryview], extra: memoryview) -> None:
    """Copy `extra` (bytes already received) into the views, then receive the rest."""
    for v in views:
        take = min(len(extra), v.nbytes)
        v[:take] = extra[:take]
        extra = extra[take:]
        pos = take
        while pos < v.nbytes:
            got = sock.recv_into(v[pos:])
            if got == 0:
                raise ConnectionError("the store closed the connection")
            pos += got
    if len(extra):
        raise ConnectionError("more bytes than one reply")
