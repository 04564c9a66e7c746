"""Pool maintenance shared by the fs connector and `shoal pool stats|verify|gc`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.connectors.fs import format as pf

STALE_TEMP_SECONDS = 3600  # temp files older than this belong to a crashed writer


@dataclass
class PoolSummary:
    num_blocks: int  # published block files
    num_bytes: int  # their total size
    num_quarantined: int  # files moved aside after failing verification
    num_temp: int  # in-progress (or crashed) writes


def pool_stats(root: Path) -> PoolSummary:
    files = list(pf.iter_block_files(root))
    sizes = sum(_size(p) for p in files)
    quarantine = root / "quarantine"
    num_q = len(list(quarantine.iterdir())) if quarantine.is_dir() else 0
    return PoolSummary(len(files), sizes, num_q, len(list(_temp_files(root))))


def verify_pool(root: Path) -> tuple[int, list[tuple[str, str]]]:
    """Check every file's header and payload checksum (namespace-agnostic); corrupt files are
    quarantined. Returns (number ok, [(file name, reason)])."""
    ok, bad = 0, []
    for path in pf.iter_block_files(root):
        try:
            with open(path, "rb") as f:
                header = pf.parse_header(f.read(pf.HEADER_SIZE))
                payload = f.read()
            if header.key.hex() != path.stem:
                raise pf.CorruptBlock("key", "header key differs from the file name")
            if len(payload) != header.payload_len:
                raise pf.CorruptBlock("truncated", f"{len(payload)} of {header.payload_len} bytes")
            if pf.checksum(payload) != header.checksum:
                raise pf.CorruptBlock("checksum", "payload checksum mismatch")
            ok += 1
        except pf.CorruptBlock as e:
            bad.append((path.name, e.reason))
            pf.quarantine(root, bytes.fromhex(path.stem), e.reason)
        except (OSError, ValueError) as e:
            bad.append((path.name, f"unreadable: {e}"))
    return ok, bad


def trim_pool(root: Path, max_bytes: int) -> int:
    """Delete least recently used block files until the pool holds at most 90% of max_bytes
    (once above max_bytes). Readers that have a file open keep reading it (POSIX unlink);
    a reader that opens it later sees a miss. Returns the number of files removed."""
    entries = []
    for p in pf.iter_block_files(root):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(e[1] for e in entries)
    if total <= max_bytes:
        return 0
    removed = 0
    for _, size, p in sorted(entries):
        if total <= max_bytes * 0.9:
            break
        try:
            p.unlink()
            removed += 1
        except FileNotFoundError:
            pass
        total -= size
    return removed


def remove_stale_temp_files(root: Path, older_than: float = STALE_TEMP_SECONDS) -> int:
    now, removed = time.time(), 0
    for p in _temp_files(root):
        try:
            if now - p.stat().st_mtime > older_than:
                p.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


def _temp_files(root: Path):
    blocks = root / "blocks"
    if blocks.is_dir():
        for sub in blocks.iterdir():
            if sub.is_dir():
                yield from (p for p in sub.iterdir() if p.name.endswith(".tmp"))


def _size(p: Path) -> int:
    try:
        return os.stat(p).st_size
    except FileNotFoundError:
        return 0
