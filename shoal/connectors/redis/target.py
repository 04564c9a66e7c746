"""Which Redis a pool names, and a client for it.

    redis://[[user]:password@]host[:port][/db]        one server (Redis or Valkey)
    rediss://...                                      the same over TLS
    redis://host1:port1,redis://host2:port2,...       a Redis Cluster (its seed nodes;
    (or host1:port1,host2:port2 after the first)      db 0, the only one a cluster has)

The password comes from the URL, else from SHOAL_REDIS_PASSWORD. No URL with its
password is ever logged or put into an error message (`RedisTarget.display`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

PASSWORD_ENV = "SHOAL_REDIS_PASSWORD"
DEFAULT_PORT = 6379


@dataclass(frozen=True)
class RedisTarget:
    nodes: tuple[tuple[str, int], ...]  # (host, port): one server, or a cluster's seeds
    is_cluster: bool
    db: int
    use_tls: bool
    username: str | None
    password: str | None

    @property
    def display(self) -> str:
        """The target for logs and errors: no password."""
        scheme = "rediss" if self.use_tls else "redis"
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}/{self.db}" + (" (cluster)" if self.is_cluster else "")


def is_redis_url(text: str) -> bool:
    return isinstance(text, str) and text.startswith(("redis://", "rediss://"))


def parse_target(url: str, cluster: bool = False) -> RedisTarget:
    """ValueError naming what is wrong (never echoing a password)."""
    if not is_redis_url(url):
        raise ValueError("redis connector: url must start with redis:// or rediss://")
    parts = [p.strip() for p in url.split(",")]
    first = urlsplit(parts[0])
    nodes, db = [], 0
    for i, part in enumerate(parts):
        if i and "://" not in part:
            part = f"{first.scheme}://{part}"
        u = urlsplit(part)
        if u.scheme != first.scheme:
            raise ValueError("redis connector: every URL of a cluster must use the same "
                             f"scheme ({first.scheme}://)")
        if not u.hostname:
            raise ValueError(f"redis connector: URL {i + 1} names no host")
        try:
            port = u.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"redis connector: URL {i + 1} has a bad port") from None
        path = u.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"redis connector: the database must be a number, got {path!r}")
            if i and int(path) != db:
                raise ValueError("redis connector: the URLs of a cluster name different "
                                 "databases")
            db = int(path)
        if u.query:
            raise ValueError("redis connector: URL query options are not supported "
                             "(give connector options instead)")
        nodes.append((u.hostname, port))
    is_cluster = cluster or len(nodes) > 1
    if is_cluster and db != 0:
        raise ValueError(f"redis connector: a Redis Cluster has only database 0, got {db}")
    password = unquote(first.password) if first.password else os.environ.get(PASSWORD_ENV)
    username = unquote(first.username) if first.username else None
    return RedisTarget(tuple(nodes), is_cluster, db, first.scheme == "rediss", username,
                       password or None)


def make_client(target: RedisTarget, timeout_s: float, max_connections: int,
                tls_options: dict | None = None):
    """A thread-safe client (a pool of up to `max_connections` connections per server).
    Commands are not retried by the client: a failure reaches the store, which turns it
    into misses and backs off (store.py). A cluster's client asks a node for the slot map
    here: the client's error if none answers."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    connection_class = _connection_class(target.use_tls)
    common = dict(username=target.username, password=target.password,
                  socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  retry=Retry(NoBackoff(), 0), connection_class=connection_class,
                  protocol=2)  # RESP2: no push messages between a command and its reply
    if target.use_tls:
        common.update(tls_options or {})
    if target.is_cluster:
        from redis.cluster import ClusterNode, RedisCluster
        # given a url, the cluster client builds each node's pool with our connection
        # class (TLS included: the class is an SSL connection then); without one it
        # would drop the class
        host, port = target.nodes[0]
        return RedisCluster(url=f"redis://{host}:{port}",
                            startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                            max_connections=max_connections, **common)
    host, port = target.nodes[0]
    return redis.Redis(connection_pool=redis.BlockingConnectionPool(
        host=host, port=port, db=target.db, max_connections=max_connections,
        timeout=timeout_s, **common))


# a part of a value below this is copied into the command's text (one send, not two: each
# send is a system call that gives up the GIL, and I/O threads then queue for it)
SMALL_PART_BYTES = 6000


class ValueParts:
    """One value given as the buffers it is made of (a block's header, then its payload):
    sent one after the other, never joined into a copy."""

    def __init__(self, *parts: memoryview | bytes):
        self.parts = parts
        self.nbytes = sum(memoryview(p).nbytes for p in parts)


def _packer():
    """The pure-Python command packer (values past 6000 bytes sent as they are), which
    also sends a `ValueParts` argument part by part."""
    from redis._parsers import Encoder
    from redis.connection import PythonRespSerializer

    class Packer(PythonRespSerializer):
        def pack(self, *args):
            if not any(isinstance(a, ValueParts) for a in args):
                return super().pack(*args)
            out, small = [], [b"*%d\r\n" % len(args)]
            for arg in args:
                if isinstance(arg, ValueParts):
                    small.append(b"$%d\r\n" % arg.nbytes)
                    for part in arg.parts:  # small parts join the command's text: fewer sends
                        if memoryview(part).nbytes < SMALL_PART_BYTES:
                            small.append(bytes(part))
                        else:
                            out += [b"".join(small), part]
                            small = []
                    small.append(b"\r\n")
                else:
                    arg = self.encode(arg)
                    small += [b"$%d\r\n" % len(arg), arg, b"\r\n"]
            return out + [b"".join(small)]
    return Packer(6000, Encoder("utf-8", "strict", False).encode)


def _connection_class(use_tls: bool):
    """The client's connection class, sending large values from their own buffers. With
    hiredis installed the client packs every command into one new bytes object: a 720 KiB
    SET then cost 1.8-3.4 ms (a fresh copy of the value each time) against 0.7-0.8 ms
    with the pure-Python packer, which sends a value past 6000 bytes as it is (measured
    here over loopback). Replies are still parsed by hiredis."""
    import redis

    base = redis.SSLConnection if use_tls else redis.Connection

    class LargeValueConnection(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("command_packer", _packer())
            super().__init__(*args, **kwargs)
    return LargeValueConnection
