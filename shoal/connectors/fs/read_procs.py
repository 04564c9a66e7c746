"""Block files read by helper processes straight into the host tier (`read_processes`).

Why processes: an I/O thread's read of a block file is four system calls (open, fstat,
preadv, close), and each one lets go of the GIL and takes it back. Through one GIL, eight
threads read 512 KiB files at 5-7 GB/s on an H100 host whatever their number; eight
processes read them at 13 GB/s and sixteen at 22 (`MODES=procs scripts/io_probe.py`).
In an engine the I/O threads' own CUDA calls queue for the same GIL, so a Llama-1B load
of 8k tokens from files ran at ~8 GB/s.

A read process has a GIL of its own and no torch: it maps the tier's slab (a memfd the
engine's process made and pinned, host_tier.py) and reads each block file straight into
its slot, with every check of the in-process read (format.read_block_into). An I/O thread
splits a chunk among its part of the processes (`ReadProcesses.read`), sends each its
share in one message and waits, off the GIL, for the answers: per block the header's
checksum of its payload, or why it is not usable. The processes start at bring-up; they
end when the pipe closes (the worker's shutdown, or the engine's process dying).

A process that dies is not used again, and the thread whose share it held reads that
chunk itself; with none left, the I/O threads read the files themselves.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path

from shoal.connectors.fs import format as pf
from shoal.connectors.store.block_format import BlockMissing, CorruptBlock

log = logging.getLogger(__name__)

STOP_WAIT_S = 2.0  # how long a read process gets to end after its pipe closes
NICENESS = 10  # added to a read process's nice value (it runs behind the engine's threads)
MIN_SHARE = 4  # the fewest blocks of a chunk one read process is given when it is split
REFILL_S = 0.001  # a thread with shares not sent looks for an idle process this often

# A read process imports only what it runs (no shoal/__init__, no torch): the packages
# above this module are made as empty namespaces first; and nothing from the engine's
# working directory (`-c` puts it first on the path)
_BOOT = """import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
import os, types
top = sys.argv[1]
for name in ("shoal", "shoal.connectors", "shoal.connectors.store", "shoal.connectors.fs"):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(top, *name.split(".")[1:])]
    sys.modules[name] = module
from shoal.connectors.fs.read_procs import serve
serve(int(sys.argv[2]), int(sys.argv[3]))
"""


class ReadProcesses:
    """`count` read processes over the pool at `root`, reading blocks of `spec` (a
    store.base.BlockSpec) into the rows of a slab of `spec.nbytes`-byte rows that the
    memfd `slab_fd` holds (`slab_nbytes` long), for `readers` threads reading through
    them at once (each splits its chunks among its fair part of the processes)."""

    def __init__(self, root: Path, spec, slab_fd: int, slab_nbytes: int, count: int,
                 touch_after: float | None, readers: int = 1):
        # blocks read whose header (and payload, if verified there) passed (tests, probes)
        self.num_blocks_read = 0
        self.readers = max(1, readers)
        self._idle: list[Connection] = []  # ready and not reading
        self._starting: list[Connection] = []  # not ready yet (importing, mapping the slab)
        self._procs: dict[Connection, subprocess.Popen] = {}
        self._cond = threading.Condition()
        top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        setup = (str(root), spec.namespace, tuple(spec.shape), str(spec.dtype), spec.nbytes,
                 slab_nbytes, touch_after)
        try:
            for _ in range(count):
                ours, theirs = socket.socketpair()
                with theirs:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _BOOT, top, str(theirs.fileno()), str(slab_fd)],
                        pass_fds=(theirs.fileno(), slab_fd), stdin=subprocess.DEVNULL)
                conn = Connection(ours.detach())
                self._procs[conn] = proc
                conn.send(setup)
                self._starting.append(conn)
        except BaseException:
            self.close()
            raise

    @property
    def num_alive(self) -> int:
        with self._cond:
            return len(self._procs)

    @property
    def pids(self) -> list[int]:
        with self._cond:
            return [p.pid for p in self._procs.values()]

    def read(self, keys: list[bytes], first_row: int, verify: bool) -> list | None:
        """Read block `keys[j]` into slab row `first_row + j`, each verified unless `verify`
        is False (then every header field is still checked). Per block: the header's
        checksum of the payload, or the exception a read in this process would have
        raised (BlockMissing, CorruptBlock, OSError). None if no process took the chunk
        (none is ready, or one that took part of it died): the caller reads it.

        The chunk is split in even shares (at least MIN_SHARE blocks each), one for each
        process of the calling thread's part of them (the `readers` threads share them
        alike): a few I/O threads keep many processes reading, and the threads' own work
        (the copies' launch) queues for the GIL behind fewer threads. The thread starts
        with one process (waited for if none is idle) and those idle now; a share goes to
        the first of its processes free, or to one that became idle meanwhile. Once this
        returns, no process writes the rows."""
        if not keys:
            return []
        first = self._take()
        if first is None:
            return None
        # (rounded up: a part rounded down leaves processes idle while threads read)
        most = max(1, min(-(-self.num_alive // self.readers), len(keys) // MIN_SHARE))
        unsent = deque(_shares(len(keys), most))
        hand = [first] + self._take_idle(most - 1)  # ours, not reading
        pending: dict[Connection, tuple[int, int]] = {}  # sent a share, not answered yet
        answers: list = [None] * len(keys)
        lost = None
        try:
            while unsent or pending:
                if unsent and lost is None:
                    hand += self._take_idle(min(len(unsent), most - len(pending)) - len(hand))
                while hand and unsent and lost is None:
                    conn, (a, b) = hand.pop(0), unsent.popleft()
                    try:
                        conn.send((keys[a:b], first_row + a, verify))
                    except BaseException as e:  # (a send cut short leaves the pipe unusable)
                        lost = self._fail(conn, e)  # the shares sent are still waited for,
                        continue  # no more are sent (the caller reads the chunk)
                    pending[conn] = (a, b)
                if hand and (not unsent or lost is not None):  # nothing more for them
                    self._hand_back(hand)
                    hand = []
                if not pending:
                    break
                try:  # with shares left, a process that became idle is looked for often
                    ready = wait(list(pending), REFILL_S if unsent and lost is None else None)
                except OSError as e:  # (one closed by `close`: the engine is shutting down)
                    for conn in pending:
                        self._lose(conn, e)
                    pending, lost = {}, e
                    continue
                for conn in ready:
                    a, b = pending.pop(conn)
                    try:
                        answers[a:b] = conn.recv()
                    except BaseException as e:
                        lost = self._fail(conn, e)
                        continue
                    hand.append(conn)
        except BaseException as e:
            for conn in pending:  # (may still write their rows: ended before this returns)
                self._lose(conn, e)
            raise
        finally:
            self._hand_back(hand)
        if lost is not None:
            return None  # the caller reads the chunk itself
        with self._cond:
            self.num_blocks_read += sum(isinstance(a, int) for a in answers)
        return [_outcome(a) for a in answers]

    def _fail(self, conn: Connection, error: BaseException) -> BaseException:
        """A process whose pipe failed mid-read is lost; `error` is returned if it is a
        broken pipe (the process died), else raised."""
        self._lose(conn, error)
        if not isinstance(error, (EOFError, OSError)):
            raise error
        return error

    def _hand_back(self, conns: list[Connection]) -> None:
        """Processes a thread took, idle again."""
        if conns:
            with self._cond:
                self._idle.extend(conns)
                self._cond.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until no process is still starting; True if none
        is. Loads never wait for this (a thread reads while its process starts): benches
        and tests that want the processes to read do."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                failed = self._collect_started()
                starting = list(self._starting)
            for conn, error in failed:
                self._lose(conn, error)
            left = deadline - time.monotonic()
            if not starting or left <= 0:
                return not starting
            try:
                wait(starting, min(left, 0.05))
            except OSError:  # (one closed meanwhile, by a thread that lost it)
                pass

    def _collect_started(self) -> list[tuple[Connection, BaseException]]:
        """(Under the lock) Processes that said ready become idle; those that could not
        start are returned, to be lost once the lock is let go of."""
        failed = []
        for conn in [c for c in self._starting if c.poll()]:
            self._starting.remove(conn)
            try:
                conn.recv()  # its "ready"
                self._idle.append(conn)
            except (EOFError, OSError) as e:  # it could not start
                failed.append((conn, e))
        return failed

    def _take_idle(self, most: int) -> list[Connection]:
        """Up to `most` more processes that are idle now (no wait)."""
        if most <= 0:
            return []
        with self._cond:
            failed = self._collect_started()
            taken, self._idle = self._idle[:most], self._idle[most:]
        for conn, error in failed:
            self._lose(conn, error)
        return taken

    def _take(self) -> Connection | None:
        """An idle read process; None if none is left, or if those not reading are still
        starting (the caller reads meanwhile: a first load never waits for a start)."""
        failed = []
        try:
            with self._cond:
                while True:
                    failed += self._collect_started()
                    if self._idle:
                        return self._idle.pop()
                    if self._starting or len(self._procs) <= len(failed):
                        return None
                    self._cond.wait()
        finally:
            for conn, error in failed:
                self._lose(conn, error)

    def _lose(self, conn: Connection, error: BaseException) -> None:
        with self._cond:
            proc = self._procs.pop(conn, None)
            self._cond.notify_all()
            left = len(self._procs)
        log.warning("a pool read process failed (%r): %s", error,
                    f"{left} left" if left else "the I/O threads read the files from now on")
        conn.close()
        if proc is not None:
            _stop(proc)

    def close(self) -> None:
        """End every read process (none may be reading: the I/O threads have stopped)."""
        with self._cond:
            procs, self._procs, self._idle, self._starting = self._procs, {}, [], []
            self._cond.notify_all()
        for conn in procs:
            conn.close()  # its process reads the end of its pipe and exits
        for proc in procs.values():
            _stop(proc)


def _shares(n: int, k: int) -> list[tuple[int, int]]:
    """[a, b) of each of k shares of n items, in order, as even as can be (sizes differ by
    at most one)."""
    base, extra = divmod(n, k)
    bounds = [0]
    for j in range(k):
        bounds.append(bounds[-1] + base + (j < extra))
    return list(zip(bounds, bounds[1:]))


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _outcome(answer):
    """A read process's answer for one block as the in-process read gives it."""
    if isinstance(answer, int):
        return answer
    kind, *detail = answer
    if kind == "missing":
        return BlockMissing(*detail)
    if kind == "corrupt":
        return CorruptBlock(*detail)
    return OSError(*detail)


def serve(sock_fd: int, slab_fd: int) -> None:
    """A read process: answer read requests until the engine's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle
    # below the engine's threads: where the CPUs are all busy, a forward's launch goes first
    os.nice(NICENESS)
    conn = Connection(sock_fd)
    try:
        root, namespace, shape, dtype, block_nbytes, slab_nbytes, touch_after = conn.recv()
        root = Path(root)
        # its page tables made now: a first write to each 4 KiB page of a fresh mapping
        # faults, which made a first read into the slab ~5x slower (2.5 against 13 GB/s)
        slab = memoryview(mmap.mmap(slab_fd, slab_nbytes,
                                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)))
        os.close(slab_fd)
        dirs = pf.BlockDirs(root)
        conn.send("ready")
        while True:
            keys, first_row, verify = conn.recv()
            conn.send([_read(root, namespace, key, slab, (first_row + j) * block_nbytes,
                             block_nbytes, shape, dtype, touch_after, dirs, verify)
                       for j, key in enumerate(keys)])
    except (EOFError, OSError):  # the engine's end closed (a broken pipe is one)
        return


def _read(root, namespace, key, slab, at, nbytes, shape, dtype, touch_after, dirs, verify):
    """One block into the slab at byte `at`: its checksum, or why it is not usable."""
    try:
        return pf.read_block_into(root, namespace, key, slab[at:at + nbytes], shape, dtype,
                                  touch_after=touch_after, dirs=dirs, verify=verify)
    except BlockMissing as e:
        return ("missing", str(e))
    except CorruptBlock as e:
        return ("corrupt", e.reason, str(e).partition(": ")[2])
    except OSError as e:
        return ("oserror", str(e))
