"""Pool maintenance shared by the fs connector and `shoal pool stats|verify|gc`.

The tools act only on regular files inside the pool: entries are found with
format.scan_blocks (never following a link) and every file is opened, moved or deleted
relative to a directory fd opened without following links. Anything else (links, FIFOs,
sockets, devices, misnamed files, foreign directories) is reported, never touched.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.connectors.fs import format as pf

STALE_TEMP_SECONDS = 3600  # temp files older than this belong to a crashed writer


@dataclass
class PoolSummary:
    num_blocks: int  # published block files
    num_bytes: int  # their total size
    num_quarantined: int  # files moved aside after failing verification
    num_temp: int  # in-progress (or crashed) writes
    num_skipped: int  # entries below blocks/ that are not Shoal's (links, FIFOs, misnamed)


@dataclass
class VerifyReport:
    num_ok: int = 0  # block files whose header and checksum are right
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (file name, reason)
    # corrupt files left in place: (file name, why they could not be moved)
    not_quarantined: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path in the pool, why)


def check_pool(root: Path) -> None:
    """ValueError, one line naming the path, unless root is a directory holding real blocks/
    (and, if present, quarantine/) directories."""
    if not os.path.isdir(root):
        why = "not a directory" if os.path.lexists(root) else "no such directory"
        raise ValueError(f"{str(root)!r} is not a Shoal KV pool ({why})")
    for sub in ("blocks", "quarantine"):
        try:
            os.close(pf.open_pool_dir(root, sub))
        except FileNotFoundError:
            if sub == "blocks":
                raise ValueError(f"{str(root)!r} is not a Shoal KV pool (no blocks/ directory)")
        except OSError as e:
            raise ValueError(f"{str(root)!r} is not a usable Shoal KV pool: {e.strerror}") from None


def pool_stats(root: Path) -> PoolSummary:
    s = PoolSummary(0, 0, _num_quarantined(root), 0, 0)
    for entry in pf.scan_blocks(root):
        if entry.kind == "block":
            s.num_blocks += 1
            s.num_bytes += entry.size
        elif entry.kind == "temp":
            s.num_temp += 1
        else:
            s.num_skipped += 1
    return s


def verify_pool(root: Path) -> VerifyReport:
    """Check every block file's header, length and checksum (namespace-agnostic, with bounded
    memory); corrupt files are quarantined. Other entries are reported in `skipped`; temp
    files are left to gc."""
    report = VerifyReport()
    for entry in pf.scan_blocks(root):
        if entry.kind == "temp":
            continue
        if entry.kind != "block":
            report.skipped.append((entry.relpath, entry.kind))
            continue
        try:
            verify_file(entry.dir_fd, entry.name)
            report.num_ok += 1
        except pf.CorruptBlock as e:
            report.corrupt.append((entry.name, e.reason))
            try:
                pf.quarantine_file(root, entry.sub, entry.name, e.reason)
            except OSError as q:
                report.not_quarantined.append((entry.name, q.strerror or str(q)))
        except OSError as e:  # replaced by a special file meanwhile, or unreadable
            report.skipped.append((entry.relpath, e.strerror or str(e)))
    return report


def verify_file(dir_fd: int, name: str) -> None:
    """Check one block file (a regular file, or NotRegularFile: never read) without reading
    more than format.VERIFY_CHUNK at a time; CorruptBlock if it fails. The header's payload
    length is checked against its shape and dtype, the largest a block can be, and the
    file size before any payload is read."""
    fd, st = pf.open_regular_file(name, dir_fd)
    try:
        header = pf.parse_header(os.pread(fd, pf.HEADER_SIZE, 0))
        if header.key.hex() != name.removesuffix(".kv"):
            raise pf.CorruptBlock("key", "header key differs from the file name")
        pf.check_payload_size(header)  # a header claiming a huge payload: never read
        expected = pf.HEADER_SIZE + header.payload_len
        if st.st_size != expected:
            raise pf.CorruptBlock("truncated" if st.st_size < expected else "length",
                                  f"file of {st.st_size} bytes, header says {expected}")
        if pf.checksum_of_file(fd, pf.HEADER_SIZE, header.payload_len) != header.checksum:
            raise pf.CorruptBlock("checksum", "payload checksum mismatch")
    finally:
        os.close(fd)


def trim_pool(root: Path, max_bytes: int) -> int:
    """Delete least recently used block files until the pool holds at most 90% of max_bytes
    (once above max_bytes; 0 removes every block file). Readers that have a file open keep
    reading it (POSIX unlink); a reader that opens it later sees a miss. Returns the number
    of files removed."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    entries = [(e.mtime, e.size, e.sub, e.name) for e in pf.scan_blocks(root) if e.kind == "block"]
    total = sum(e[1] for e in entries)
    if total <= max_bytes:
        return 0
    removed = 0
    for _, size, sub, name in sorted(entries):
        if total <= max_bytes * 0.9:
            break
        removed += remove_pool_file(root, sub, name)
        total -= size
    return removed


def remove_stale_temp_files(root: Path, older_than: float = STALE_TEMP_SECONDS) -> int:
    now = time.time()
    stale = [(e.sub, e.name) for e in pf.scan_blocks(root)
             if e.kind == "temp" and now - e.mtime > older_than]
    return sum(remove_pool_file(root, sub, name) for sub, name in stale)


def remove_pool_file(root: Path, sub: str, name: str) -> bool:
    """Unlink root/blocks/<sub>/<name> if it is still a regular file reached without links;
    False if it is gone or anything else (left alone)."""
    try:
        dir_fd = pf.open_pool_dir(root, "blocks", sub)
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(name, dir_fd=dir_fd)  # even if swapped meanwhile: unlink never follows
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dir_fd)


def _num_quarantined(root: Path) -> int:
    try:
        fd = pf.open_pool_dir(root, "quarantine")
    except FileNotFoundError:
        return 0
    try:
        with os.scandir(fd) as it:
            return sum(1 for _ in it)
    finally:
        os.close(fd)
