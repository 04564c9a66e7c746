"""Blocks as values in Redis, Valkey or a Redis Cluster: the redis pool's `BlockStore`.

    <prefix>{<key hex>}                        one block: header + payload (block_format)
    <prefix>quarantine:{<key hex>}:<reason>    a value that failed verification (expires)

The key hex is the fs pool's file name: the same block has the same name in both. The
braces are a cluster hash tag: a block and its quarantine name live in one slot, so a
bad value is renamed aside in one command on any deployment.

- Publish: one `SETNX name value` (`SET name value NX EX ttl` with a TTL): whole or not
  at all, never overwriting. (A large value that ends its command is kept by Redis without
  a copy: `SET ... NX` ran saves at 0.85-0.9 of a plain SET, SETNX at ~1.0, measured here.)
- Lookup: `EXISTS` for every key of a request in one pipelined round trip.
- Load: a unit's blocks in pipelined round trips of about PIPELINE_BYTES (`GET`, or
  `GETEX` with a TTL: a block in use stays), then each value is checked (header, length, checksum) as it is
  copied into its KV block. A value that fails is renamed aside and recomputed.
- Capacity is the store's (`maxmemory` with `allkeys-lru`, or a TTL): a write the store
  refuses (full, read-only replica) is a failed save, counted, never fatal.
- A lost connection, a timeout or a store that is down: the operation is a miss (lookups
  answer "not there", loads fail and are recomputed, saves are dropped), counted in
  `store_errors`, and the store is left alone for a while (`_Backoff`: 50 ms doubling to
  5 s) so that requests meanwhile do not each wait for a timeout; then the client
  connects again. No request fails for it, and no call waits past `timeout_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from shoal.connectors.redis.direct_read import read_value_into
from shoal.connectors.redis.target import RedisTarget, ValueParts, make_client
from shoal.connectors.store.base import BlockSpec, BlockStore, StoreError, UnitReader
from shoal.connectors.store.block_format import (HEADER_SIZE, BlockMissing, CorruptBlock,
                                                 check_header, checksum, encode_header,
                                                 parse_header)

log = logging.getLogger(__name__)

QUARANTINE_TTL_SECONDS = 7 * 24 * 3600  # kept a while to be looked at, then gone
# Values a load fetches in one pipelined round trip: up to this many bytes (at least one
# value). Measured on this 2-core machine over loopback with the Python client (hiredis),
# two threads: 3 KiB values 0.03 GB/s one GET at a time, 0.29 in pipelines of 32; 128-256
# KiB values 0.9-1.1 GB/s alone, 1.9-2.7 in pipelines of ~1 MiB; 720 KiB values 1.7-2.0
# GB/s alone, 0.65 in pipelines of 4 (2.9 MB): past a few MB a pipeline of large values
# is slower than single commands, so large blocks go one GET each.
PIPELINE_BYTES = 1 << 20


class _Backoff:
    """After a failed round trip the store is taken as down for a delay that doubles with
    each failure in a row (MIN_S to MAX_S); the first success ends it."""

    MIN_S, MAX_S = 0.05, 5.0

    def __init__(self):
        self._lock = threading.Lock()
        self._delay = 0.0
        self._until = 0.0

    def is_down(self) -> bool:
        return time.monotonic() < self._until

    def failed(self) -> None:
        with self._lock:
            self._delay = min(max(2 * self._delay, self.MIN_S), self.MAX_S)
            self._until = time.monotonic() + self._delay

    def succeeded(self) -> None:
        if self._delay:
            with self._lock:
                self._delay, self._until = 0.0, 0.0


def store_errors():
    """The client's exceptions that mean the store could not be used (not our bug)."""
    import redis
    return (redis.exceptions.RedisError, OSError)


class RedisStore(BlockStore):
    def __init__(self, target: RedisTarget, prefix: str, timeout_s: float,
                 ttl_s: int | None, max_connections: int, tls_options: dict | None = None):
        self.target, self.prefix, self.ttl_s = target, prefix, ttl_s
        self._connect = lambda: make_client(target, timeout_s, max_connections, tls_options)
        self._client = None  # made at the first use (a cluster's needs a node that answers)
        self._connect_lock = threading.Lock()
        self._errors = store_errors()
        self._backoff = _Backoff()
        self._lock = threading.Lock()
        self._stats = dict(store_errors=0, store_refused_writes=0, store_set_aside=0)

    def name(self, key: bytes) -> str:
        return f"{self.prefix}{{{key.hex()}}}"

    def quarantine_name(self, key: bytes, reason: str) -> str:
        return f"{self.prefix}quarantine:{{{key.hex()}}}:{reason}"

    @property
    def client(self):
        """The client, made now if it is not yet; the client's error if it cannot be."""
        if self._client is None:
            with self._connect_lock:  # one connects; the other threads wait for it
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def warm_up(self, num_threads: int) -> None:
        """Open a connection for each I/O thread now (one server): made at a fresh
        engine's first load they cost it a connect each, and its first load's rate is
        what the engine plans the split of that hit by."""
        if self.target.is_cluster or self._backoff.is_down():
            return
        try:
            pool = self.client.connection_pool
            conns = [pool.get_connection() for _ in range(num_threads)]
            for conn in conns:
                pool.release(conn)
        except self._errors as e:
            log.warning("redis pool %s: connections not opened at bring-up: %s",
                        self.target.display, e)

    def ping(self) -> None:
        """Raises the client's error if the store cannot be used now (bring-up's check)."""
        self.client.ping()

    # -- BlockStore ---------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes], stop_at_miss: bool = False,
                 group: int = 1) -> list[bool]:  # one pipelined round trip for all of them
        if not keys:
            return []
        try:
            found = self._pipelined("exists", [self.name(k) for k in keys])
        except StoreError:
            return [False] * len(keys)
        return [bool(n) for n in found]

    def read_unit(self, keys: Sequence[bytes], spec: BlockSpec) -> UnitReader:
        return _ValueReader(self, keys, spec)

    def write(self, key: bytes, payload: memoryview, spec: BlockSpec) -> bool:
        header = encode_header(spec.namespace, key, spec.shape, spec.dtype, payload.nbytes,
                               checksum(payload))
        # header and payload go out one after the other, straight from the KV cache's
        # memory: a fresh 720 KiB bytes per block (mapped, touched, unmapped) to join them
        # in ran saves at a third of the rate
        value = ValueParts(header, payload.cast("B"))
        name = self.name(key)
        if self.ttl_s is None:  # SETNX: the value last, which Redis keeps without a copy
            written = self._call(lambda c: c.setnx(name, value), writing=True)
        else:
            written = self._call(lambda c: c.set(name, value, nx=True, ex=self.ttl_s),
                                 writing=True)
        return bool(written)

    def set_aside(self, key: bytes, error: CorruptBlock) -> None:
        """Rename the bad value aside (it expires); if it cannot be, delete it. Never
        raises: a value that stays is found bad again and recomputed again."""
        import redis
        name, aside = self.name(key), self.quarantine_name(key, error.reason)
        try:
            self._call(lambda c: c.rename(name, aside))
            self._call(lambda c: c.expire(aside, QUARANTINE_TTL_SECONDS))
        except StoreError as e:
            if isinstance(e.__cause__, redis.exceptions.ResponseError):  # e.g. gone meanwhile
                return
            log.warning("pool value %s is corrupt (%s) and could not be set aside (%s)",
                        name, error, e)
            return
        with self._lock:
            self._stats["store_set_aside"] += 1
        log.warning("pool value %s is corrupt (%s): set aside as %s, recomputing", name,
                    error, aside)

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except self._errors:
                pass

    # -- round trips --------------------------------------------------------------------

    def read_value_into(self, key: bytes, head: memoryview, dest: memoryview) -> int | None:
        """The value of `key` read straight into head (the header) and dest (the payload)
        if it is their length (direct_read.py); its length, or None if there is none."""
        args = ("GET", self.name(key)) if self.ttl_s is None else (
            "GETEX", self.name(key), "EX", self.ttl_s)
        return self._call(lambda c: read_value_into(c, args, [head, dest]))

    def get_values(self, names: list[str]) -> list[bytes | None]:
        """One round trip (pipelined if several): each name's value (None: there is none)."""
        kw = {} if self.ttl_s is None else {"ex": self.ttl_s}
        command = "get" if self.ttl_s is None else "getex"
        if len(names) == 1:
            return [self._call(lambda c: getattr(c, command)(names[0], **kw))]
        return self._pipelined(command, names, **kw)

    def _pipelined(self, command: str, names: list[str], **kw) -> list:
        def run(client):
            pipe = client.pipeline(transaction=False)
            for n in names:
                getattr(pipe, command)(n, **kw)
            return pipe.execute()
        return self._call(run)

    def _call(self, fn, writing: bool = False):
        """fn(client), its failures as StoreError (counted; the backoff starts on one that
        means the store cannot be reached); StoreError at once while backing off."""
        import redis
        if self._backoff.is_down():
            raise StoreError(f"{self.target.display} is unavailable (backing off)")
        try:
            result = fn(self.client)  # (a client that cannot be made fails here too)
        except (redis.exceptions.ResponseError, redis.exceptions.ReadOnlyError) as e:
            # the store answered and refused (full: OOM; a read-only replica; a bad key)
            if writing:
                with self._lock:
                    self._stats["store_refused_writes"] += 1
            raise StoreError(f"{self.target.display} refused: {e}") from e
        except self._errors as e:
            self._backoff.failed()
            with self._lock:
                self._stats["store_errors"] += 1
            raise StoreError(f"{self.target.display}: {type(e).__name__}: {e}") from e
        self._backoff.succeeded()
        return result


class _ValueReader(UnitReader):
    """A unit's values: large ones (past half of PIPELINE_BYTES) read one at a time
    straight into the KV cache (one server: direct_read.py; through the client for a
    cluster), smaller ones fetched a group (PIPELINE_BYTES) at a time as reads reach them."""

    def __init__(self, store: RedisStore, keys: Sequence[bytes], spec: BlockSpec):
        self.store, self.keys, self.spec = store, keys, spec
        self._per_group = max(1, PIPELINE_BYTES // (HEADER_SIZE + spec.nbytes))
        self._direct = self._per_group == 1 and not store.target.is_cluster
        self._values: dict[int, bytes | None] = {}  # fetched, not read yet
        self._error: StoreError | None = None  # a failed fetch: the unit's reads all fail

    def read_into(self, i: int, dest: memoryview, verify: bool = True) -> int:
        if self._error is not None:
            raise self._error
        if self._direct:
            head = memoryview(bytearray(HEADER_SIZE))
            length = self.store.read_value_into(self.keys[i], head, dest)
            if length is None:
                raise BlockMissing(self.store.name(self.keys[i]))
            if length != HEADER_SIZE + dest.nbytes:
                reason = "truncated" if length < HEADER_SIZE + dest.nbytes else "length"
                raise CorruptBlock(reason, f"value of {length} bytes")
            return _check(head, self.keys[i], self.spec, dest, verify)
        if i not in self._values:
            first = i - i % self._per_group
            group = range(first, min(first + self._per_group, len(self.keys)))
            try:
                values = self.store.get_values([self.store.name(self.keys[j]) for j in group])
            except StoreError as e:
                self._error = e
                raise
            self._values.update(zip(group, values))
        value = self._values.pop(i)  # each block read once: its bytes freed now
        if value is None:
            raise BlockMissing(self.store.name(self.keys[i]))
        return decode_into(value, self.keys[i], self.spec, dest, verify)


def decode_into(value: bytes, key: bytes, spec: BlockSpec, dest: memoryview,
                verify: bool = True) -> int:
    """Check a stored value (header fields, length, and unless `verify` is False the
    payload's checksum) and copy its payload into `dest`; the header's checksum."""
    if len(value) != HEADER_SIZE + dest.nbytes:
        reason = "truncated" if len(value) < HEADER_SIZE + dest.nbytes else "length"
        raise CorruptBlock(reason, f"value of {len(value)} bytes")
    dest[:] = memoryview(value)[HEADER_SIZE:]
    return _check(value[:HEADER_SIZE], key, spec, dest, verify)


def _check(head, key: bytes, spec: BlockSpec, dest: memoryview, verify: bool) -> int:
    """CorruptBlock unless the header describes this block and (verify) the payload in
    dest hashes to its checksum; the header's checksum."""
    header = parse_header(bytes(head))
    check_header(header, spec.namespace, key, spec.shape, spec.dtype, dest.nbytes)
    if verify and checksum(dest) != header.checksum:
        raise CorruptBlock("checksum", "payload checksum mismatch")
    return header.checksum
