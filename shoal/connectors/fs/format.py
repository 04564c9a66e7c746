"""On-disk format of one pool block, and its atomic publish / verified read.

    <root>/blocks/<key[:2]>/<key>.kv     = 128-byte header + raw payload
    <root>/quarantine/<key>.<reason>.<n> = files that failed verification

A block file holds the bytes store/block_format.py describes (header, then payload).

Nothing inside the pool can redirect Shoal: everything below the root is opened the way
safe_dir.py opens it, never through a link.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from shoal.connectors.store.block_format import (  # noqa: F401 (the pool's names)
    DTYPE_CODES, FORMAT_VERSION, HEADER_SIZE, MAGIC, MAX_DIMS, MAX_PAYLOAD_BYTES, BlockHeader,
    BlockMissing, CorruptBlock, check_header, check_payload_size, checksum, encode_header,
    parse_header)
from shoal.connectors.fs.safe_dir import (  # noqa: F401 (the pool's names)
    DIR_FLAGS, DIR_MODE, FILE_MODE, BlockDirs, NotRegularFile, ensure_pool_dirs, entries,
    entry_kind, open_pool_dir, open_regular_file, open_subdir)

VERIFY_CHUNK = 8 << 20  # bytes hashed at a time when a whole file is checked


def checksum_of_file(fd: int, offset: int, length: int) -> int:
    """checksum() of `length` bytes of a file from `offset`, hashed VERIFY_CHUNK at a time
    (xxh3's streaming form gives the one-shot value): memory stays bounded whatever the
    length. CorruptBlock("truncated") if the file ends first."""
    hasher = xxhash.xxh3_64()
    view = memoryview(bytearray(min(VERIFY_CHUNK, length)))
    while length > 0:
        n = os.preadv(fd, [view[:min(len(view), length)]], offset)
        if n == 0:
            raise CorruptBlock("truncated", f"file ends {length} bytes early")
        hasher.update(view[:n])
        offset, length = offset + n, length - n
    return hasher.intdigest()


def block_path(root: Path, key: bytes) -> Path:
    return Path(block_path_str(str(root), key))


def block_path_str(root: str, key: bytes) -> str:
    """block_path as a plain string (Path objects cost microseconds per block on hot paths)."""
    h = key.hex()
    return f"{root}/blocks/{h[:2]}/{h}.kv"


def is_block_file(path: str) -> bool:
    """Lookup hint: a regular file is published at this block path (from block_path_str) in a
    real directory; a link or anything else there is a miss. The read verifies the file."""
    try:
        return (stat.S_ISREG(os.lstat(path).st_mode)
                and stat.S_ISDIR(os.lstat(path[:path.rindex("/")]).st_mode))
    except OSError:
        return False


# -- blocks ------------------------------------------------------------------------------

def write_block(root: Path, namespace: bytes, key: bytes, payload: memoryview,
                shape: tuple[int, ...], dtype, dirs: BlockDirs | None = None) -> bool:
    """Publish one block atomically; False if the key already exists (never overwritten).
    OSError (the temp file removed) if it cannot: also NotADirectoryError if the block's
    directory is a link, NotRegularFile if something else occupies the block's name.
    `dirs`: directory fds to reuse (else the directories are opened for this write)."""
    h = key.hex()
    if dirs is None:
        dir_fd = open_pool_dir(root, "blocks", h[:2], create=True)
        try:
            return _write_in(dir_fd, namespace, key, payload, shape, dtype)
        finally:
            os.close(dir_fd)
    dir_fd = dirs.fd(h[:2], create=True)
    try:
        return _write_in(dir_fd, namespace, key, payload, shape, dtype)
    except FileNotFoundError:  # the directory was removed since it was opened: once more
        dirs.retire(h[:2], dir_fd)
        return _write_in(dirs.fd(h[:2], create=True), namespace, key, payload, shape, dtype)


def _write_in(dir_fd: int, namespace: bytes, key: bytes, payload: memoryview,
              shape: tuple[int, ...], dtype) -> bool:
    name = f"{key.hex()}.kv"
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        header = encode_header(namespace, key, shape, dtype, payload.nbytes, checksum(payload))
        return _publish(dir_fd, name, header, payload)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EEXIST, f"a {entry_kind(st.st_mode)} occupies {name}")
    return False


def _publish(dir_fd: int, name: str, header: bytes, payload: memoryview) -> bool:
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE,
                     dir_fd=dir_fd)
        try:
            _write_all(fd, [memoryview(header), memoryview(payload).cast("B")])
        finally:
            os.close(fd)
        try:  # atomic and never replaces an existing file
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return False
        return True
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """All of `buffers` with one writev in the common case; a short write (a signal, a
    disk filling up) continues where it stopped, so a published file is never short."""
    while buffers:
        n = os.writev(fd, buffers)
        if n == 0:
            raise OSError(errno.EIO, "write wrote nothing")
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers = buffers[1:]
        if n:
            buffers = [buffers[0][n:], *buffers[1:]]


def read_block_into(root: Path, namespace: bytes, key: bytes, dest: memoryview,
                    shape: tuple[int, ...], dtype,
                    touch_after: float | None = None, dirs: BlockDirs | None = None,
                    verify: bool = True) -> int:
    """Read a block's payload straight into `dest` and verify it. Raises BlockMissing (also
    for a link or special file: never followed or read) or CorruptBlock (then `dest` holds
    garbage the caller must not use). touch_after: refresh the file's mtime (LRU) if it is
    older than this many seconds. `dirs`: directory fds to reuse. verify=False: every
    header field is checked but the payload is not hashed (the caller verifies it against
    the returned value: a GPU does, after its copy). Returns the header's checksum of the
    payload. Past the directory opens (none with `dirs`): open, fstat, one preadv for
    header and payload together, close."""
    h = key.hex()
    fd, st = _open_block(root, h) if dirs is None else _open_block_in(dirs, h)
    try:
        size = st.st_size
        header_buf = bytearray(HEADER_SIZE)
        n = os.preadv(fd, [header_buf, dest], 0) if size >= HEADER_SIZE else size
        header = parse_header(bytes(header_buf[:min(n, HEADER_SIZE)]))
        check_header(header, namespace, key, shape, dtype, dest.nbytes)
        if size != HEADER_SIZE + dest.nbytes:
            reason = "truncated" if size < HEADER_SIZE + dest.nbytes else "length"
            raise CorruptBlock(reason, f"file of {size} bytes")
        if verify and checksum(dest) != header.checksum:
            raise CorruptBlock("checksum", "payload checksum mismatch")
        if touch_after is not None and time.time() - st.st_mtime > touch_after:
            _touch(fd)
    finally:
        os.close(fd)
    return header.checksum


def _open_block(root: Path, h: str) -> tuple[int, os.stat_result]:
    # open_pool_dir(root, "blocks", h[:2]) spelled out: this runs for every block loaded
    try:
        blocks_fd = os.open(f"{root}/blocks", DIR_FLAGS)
        try:
            dir_fd = os.open(h[:2], DIR_FLAGS, dir_fd=blocks_fd)
        finally:
            os.close(blocks_fd)
    except (FileNotFoundError, NotADirectoryError) as e:  # a link: never followed
        raise BlockMissing(f"{h}: {e}") from None
    try:
        return open_regular_file(f"{h}.kv", dir_fd)
    except (FileNotFoundError, NotRegularFile) as e:
        raise BlockMissing(f"{h}: {e}") from None
    finally:
        os.close(dir_fd)


def _open_block_in(dirs: BlockDirs, h: str) -> tuple[int, os.stat_result]:
    for attempt in range(2):
        try:
            dir_fd = dirs.fd(h[:2])
        except (FileNotFoundError, NotADirectoryError) as e:  # a link: never followed
            raise BlockMissing(f"{h}: {e}") from None
        try:
            return open_regular_file(f"{h}.kv", dir_fd)
        except NotRegularFile as e:
            raise BlockMissing(f"{h}: {e}") from None
        except FileNotFoundError as e:
            if attempt:
                raise BlockMissing(f"{h}: {e}") from None
            dirs.retire(h[:2], dir_fd)  # the directory may be a new one now: look again
    raise AssertionError("unreachable")


def _touch(fd: int) -> None:
    """Best effort (a read-only pool cannot be touched; the read itself succeeded)."""
    try:
        os.utime(fd)
    except OSError:
        pass


def quarantine(root: Path, key: bytes, reason: str) -> None:
    h = key.hex()
    quarantine_file(root, h[:2], f"{h}.kv", reason)


def quarantine_file(root: Path, sub: str, name: str, reason: str) -> None:
    """Move root/blocks/<sub>/<name> (a bad block file) into quarantine/ so no reader trips on
    it again; nothing to do if it is gone (another process may have done it). Raises OSError
    if it cannot be moved (a read-only pool; quarantine/ or the directory a link; the entry
    not a regular file): then the caller must stop using the file some other way."""
    try:
        src_fd = open_pool_dir(root, "blocks", sub)
    except FileNotFoundError:
        return
    try:
        dst_fd = open_pool_dir(root, "quarantine", create=True)
        try:
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFile(errno.EINVAL, f"{name} is a {entry_kind(st.st_mode)}")
            dst = f"{name.removesuffix('.kv')}.{reason}.{os.getpid()}.{os.urandom(3).hex()}"
            os.rename(name, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


# -- scanning (the pool tools) ------------------------------------------------------------

_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{64})\.kv")  # keys are 32 bytes
_TEMP_NAME = re.compile(r"\.([0-9a-f]{64})\.kv\.[0-9]+\.[0-9a-f]{8}\.tmp")  # see _publish


@dataclass(frozen=True)
class PoolEntry:
    """One entry below root/blocks, as a scan found it (lstat: never followed)."""

    sub: str  # its blocks/ subdirectory ("" for an entry of blocks/ itself)
    name: str
    kind: str  # "block", "temp" (a write in progress, or a crashed one), or why it is skipped
    size: int
    mtime: float
    dir_fd: int  # the open directory holding it; valid until the scan moves on

    @property
    def relpath(self) -> str:
        return f"blocks/{self.sub}/{self.name}" if self.sub else f"blocks/{self.name}"


def scan_blocks(root: Path) -> Iterator[PoolEntry]:
    """Every entry below root/blocks in name order, never following a link. Files in the
    two-hex-digit directories are "block" (a regular file named <key hex>.kv in the directory
    of its first two digits) or "temp" (a regular file named as _publish names its writes);
    anything else is yielded with why the tools skip it, and is never entered or opened.
    Nothing if blocks/ is absent; NotADirectoryError if it is a link or not a directory."""
    try:
        blocks_fd = open_pool_dir(root, "blocks")
    except FileNotFoundError:
        return
    try:
        for name, st in entries(blocks_fd):
            if stat.S_ISDIR(st.st_mode) and _SUBDIR_NAME.fullmatch(name):
                yield from _scan_subdir(blocks_fd, name)
            else:
                kind = ("misnamed directory" if stat.S_ISDIR(st.st_mode) else
                        "misplaced file" if stat.S_ISREG(st.st_mode) else entry_kind(st.st_mode))
                yield PoolEntry("", name, kind, st.st_size, st.st_mtime, blocks_fd)
    finally:
        os.close(blocks_fd)


def _scan_subdir(blocks_fd: int, sub: str) -> Iterator[PoolEntry]:
    try:
        fd = open_subdir(blocks_fd, sub, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return  # removed or replaced since it was listed
    try:
        for name, st in entries(fd):
            yield PoolEntry(sub, name, _file_kind(sub, name, st.st_mode), st.st_size,
                            st.st_mtime, fd)
    finally:
        os.close(fd)


def _file_kind(sub: str, name: str, mode: int) -> str:
    if not stat.S_ISREG(mode):
        return entry_kind(mode)
    named = _BLOCK_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name)
    if named is None or not named[1].startswith(sub):  # a reader would never look there
        return "misnamed"
    return "block" if name.endswith(".kv") else "temp"


def iter_block_files(root: Path) -> Iterator[Path]:
    """Paths of the published block files (see scan_blocks)."""
    for entry in scan_blocks(root):
        if entry.kind == "block":
            yield Path(root) / entry.relpath
