"""Opening what is inside a pool directory without ever following a link.

Below the root (which the user names, and may be a link), every directory is opened with
O_NOFOLLOW | O_DIRECTORY and every file relative to it (dir_fd), files with O_NOFOLLOW |
O_NONBLOCK and checked with fstat. A link, FIFO, socket or device where Shoal expects its
own directory or file is never followed, read, written, moved or deleted.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
# O_NONBLOCK: a FIFO planted under a block's name opens at once (then fstat refuses it)
# instead of waiting for a writer; O_NOCTTY: a device never becomes our terminal
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY


class NotRegularFile(OSError):
    """An entry where Shoal expects one of its files is something else (a link, FIFO, socket,
    device or directory): never opened for reading, never written through, moved or deleted."""


def open_pool_dir(root: Path | str, *names: str, create: bool = False) -> int:
    """A directory fd of root/names[0]/names[1]/..., each below root opened without
    following a link (root itself is followed: the user chose it), each after the first
    relative to the one before. create: make missing ones, owner-only. Raises
    FileNotFoundError if one is absent, NotADirectoryError if one is a link or not a
    directory. The caller closes the fd."""
    if not names:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    # the first by path: one system call fewer than opening root, and as strict
    fd = open_subdir(None, os.path.join(root, names[0]), create)
    try:
        for name in names[1:]:
            fd, parent = open_subdir(fd, name, create), fd
            os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_subdir(dir_fd: int | None, name: str, create: bool) -> int:
    try:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        except FileExistsError:
            pass  # another process made it meanwhile (or a link is there: refused below)
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except NotADirectoryError:
        raise NotADirectoryError(errno.ENOTDIR, f"{name}/ is a symbolic link or not a "
                                 "directory (Shoal never follows links inside a pool)") from None


def open_regular_file(name: str, dir_fd: int) -> tuple[int, os.stat_result]:
    """Open a file for reading if it is a regular file: (fd, its fstat). FileNotFoundError if
    absent; NotRegularFile for a link (never followed), FIFO (never waited on), socket,
    device or directory. The caller closes the fd."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link (O_NOFOLLOW); a socket
            raise NotRegularFile(e.errno, f"{name} is not a regular file ({e.strerror})") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"{name} is a {entry_kind(st.st_mode)}, "
                             "not a regular file")
    return fd, st


def entry_kind(mode: int) -> str:
    """What a directory entry is, in words (for reports)."""
    for test, kind in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "device"


def ensure_pool_dirs(root: Path) -> None:
    """Create root (with its parents), root/blocks and root/quarantine, owner-only. OSError if
    root cannot be a directory (a file in the way, no permission); NotADirectoryError if
    blocks/ or quarantine/ is a link or not a directory."""
    os.makedirs(root, mode=DIR_MODE, exist_ok=True)
    for sub in ("blocks", "quarantine"):
        os.close(open_pool_dir(root, sub, create=True))


class BlockDirs:
    """One process's open fds of root/blocks/<xx>, each opened once the way open_pool_dir
    opens it (never through a link) and kept: a block read or write then opens no
    directory. An fd always names the real directory it was opened on, so a directory
    replaced later by a link is still never followed; one removed or replaced is looked up
    afresh when a file is not found through it (`retire`). Thread-safe."""

    def __init__(self, root: Path | str):
        self.root = root
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []  # closed at close(): another thread may be using one
        self._lock = threading.Lock()

    def fd(self, sub: str, create: bool = False) -> int:
        fd = self._fds.get(sub)
        if fd is not None:
            return fd
        fd = open_pool_dir(self.root, "blocks", sub, create=create)
        with self._lock:
            if sub in self._fds:  # another thread opened it meanwhile
                self._retired.append(fd)
            else:
                self._fds[sub] = fd
            return self._fds[sub]

    def retire(self, sub: str, fd: int) -> None:
        with self._lock:
            if self._fds.get(sub) == fd:
                del self._fds[sub]
                self._retired.append(fd)

    def close(self) -> None:
        with self._lock:
            for fd in [*self._fds.values(), *self._retired]:
                os.close(fd)
            self._fds, self._retired = {}, []


def entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of a directory's entries, sorted; those removed meanwhile left out."""
    with os.scandir(dir_fd) as it:
        names = sorted(e.name for e in it)
    out = []
    for name in names:
        try:
            out.append((name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)))
        except FileNotFoundError:
            pass
    return out
