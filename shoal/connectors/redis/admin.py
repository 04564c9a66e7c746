"""`shoal pool stats|verify|gc redis://...`: the fs pool's tools for a redis pool.

The same reports as for a directory (fs/admin.py). Values are found with SCAN (every node
of a cluster) under the pool's prefix, and read in batches; a value is checked by its
header first (GETRANGE), its length against the header's, and only then read whole: no
value larger than its header says a block is is ever read.
"""

from __future__ import annotations

import re
from typing import Iterator


from shoal.connectors.fs.admin import PoolSummary, VerifyReport
from shoal.connectors.redis.store import RedisStore
from shoal.connectors.store.block_format import (HEADER_SIZE, CorruptBlock,
                                                 check_payload_size, checksum, parse_header)

BATCH = 64  # values per pipelined round trip


def _names(store: RedisStore) -> Iterator[tuple[str, str]]:
    """(name, kind) of every name under the prefix: "block", "quarantined" or "foreign"."""
    p = re.escape(store.prefix)
    block = re.compile(p + r"\{([0-9a-f]{64})\}")
    aside = re.compile(p + r"quarantine:\{[0-9a-f]{64}\}:[a-z]+")
    for raw in store.client.scan_iter(match=f"{_glob_escape(store.prefix)}*", count=1000):
        name = raw.decode("utf-8", "replace")
        kind = ("block" if block.fullmatch(name) else
                "quarantined" if aside.fullmatch(name) else "foreign")
        yield name, kind


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _batches(names: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(names), BATCH):
        yield names[i:i + BATCH]


def _pipelined(store: RedisStore, command: str, names: list[str], *args) -> list:
    pipe = store.client.pipeline(transaction=False)
    for n in names:
        getattr(pipe, command)(n, *args)
    return pipe.execute()


def pool_stats(store: RedisStore) -> PoolSummary:
    s = PoolSummary(0, 0, 0, 0, 0)
    blocks = []
    for name, kind in _names(store):
        if kind == "block":
            blocks.append(name)
        elif kind == "quarantined":
            s.num_quarantined += 1
        else:
            s.num_skipped += 1
    for batch in _batches(blocks):
        sizes = _pipelined(store, "strlen", batch)
        s.num_blocks += sum(1 for n in sizes if n)
        s.num_bytes += sum(sizes)
    return s


def verify_pool(store: RedisStore) -> VerifyReport:
    """Check every block value's header, length and checksum (namespace-agnostic); corrupt
    values are set aside. Names under the prefix that are not Shoal's are `skipped`."""
    report = VerifyReport()
    blocks = []
    for name, kind in _names(store):
        if kind == "block":
            blocks.append(name)
        elif kind == "foreign":
            report.skipped.append((name, "not a block name"))
    for batch in _batches(blocks):
        heads = _pipelined(store, "getrange", batch, 0, HEADER_SIZE - 1)
        sizes = _pipelined(store, "strlen", batch)
        whole = []
        for name, head, size in zip(batch, heads, sizes):
            try:
                _check_head(name, head, size)
                whole.append(name)
            except CorruptBlock as e:
                _report_corrupt(store, report, name, e)
        values = _pipelined(store, "get", whole)
        for name, value in zip(whole, values):
            if value is None:
                continue  # gone meanwhile (evicted, expired)
            header = parse_header(value[:HEADER_SIZE])
            if checksum(memoryview(value)[HEADER_SIZE:]) != header.checksum:
                _report_corrupt(store, report, name, CorruptBlock("checksum",
                                                                  "payload checksum mismatch"))
            else:
                report.num_ok += 1
    return report


def _check_head(name: str, head: bytes, size: int) -> None:
    """CorruptBlock unless the header parses, names this key, and the value is exactly as
    long as the header's shape and dtype say a block is."""
    header = parse_header(head)
    if header.key.hex() != name[name.index("{") + 1:name.index("}")]:
        raise CorruptBlock("key", "header key differs from the value's name")
    check_payload_size(header)
    if size != HEADER_SIZE + header.payload_len:
        raise CorruptBlock("truncated" if size < HEADER_SIZE + header.payload_len else "length",
                           f"value of {size} bytes, header says {HEADER_SIZE + header.payload_len}")


def _report_corrupt(store: RedisStore, report: VerifyReport, name: str, e: CorruptBlock) -> None:
    report.corrupt.append((name, e.reason))
    key = bytes.fromhex(name[name.index("{") + 1:name.index("}")])
    try:
        store.client.rename(name, store.quarantine_name(key, e.reason))
    except Exception as q:  # noqa: BLE001 - the client's errors: reported, the run goes on
        report.not_quarantined.append((name, str(q)))


def gc_pool(store: RedisStore, max_bytes: int | None) -> tuple[int, int]:
    """Remove set-aside values; with max_bytes, delete the blocks idle longest (the
    store's LRU clock, OBJECT IDLETIME) until at most 90% of it is left once above it.
    (removed set-aside values, trimmed blocks)."""
    aside, blocks = [], []
    for name, kind in _names(store):
        (blocks if kind == "block" else aside if kind == "quarantined" else []).append(name)
    removed = sum(_pipelined(store, "delete", aside)) if aside else 0
    if max_bytes is None or not blocks:
        return removed, 0
    entries = []
    for batch in _batches(blocks):
        sizes = _pipelined(store, "strlen", batch)
        pipe = store.client.pipeline(transaction=False)
        for n in batch:
            pipe.object("idletime", n)
        idle = [i or 0 for i in pipe.execute()]
        entries += [(-i, s, n) for n, s, i in zip(batch, sizes, idle)]
    total = sum(s for _, s, _ in entries)
    if total <= max_bytes:
        return removed, 0
    trimmed = 0
    for _, size, name in sorted(entries):
        if total <= max_bytes * 0.9:
            break
        trimmed += store.client.delete(name)
        total -= size
    return removed, trimmed
