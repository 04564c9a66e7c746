"""Moving blocks between the pool's files and the KV cache through host-tier pages.

The path for a KV cache on a GPU (and for a CPU cache when a host tier is configured).
Blocks move a chunk at a time, a chunk being up to one page of blocks:

Load (on an I/O thread): a load the tier holds whole is copied from its slots straight
into the KV blocks, a run of consecutive slots and blocks a copy, nothing staged (tier
entries are verified). Otherwise, a chunk at a time: blocks the tier holds are found
there, the others are read from their files into the slots of a fresh page (by the thread,
or by read processes: `read_many`). Then, on the thread's own CUDA stream, each run of
consecutive slots goes to a device staging buffer in one host-to-device copy, the rows read
from files are verified there (gpu_xxh3.py; without Triton the CPU verifies each file as
it reads it, off the GIL), and one kernel places the rows that passed into their KV blocks
(gpu_place.py); an event marks the end. A row that fails is not placed and is reported
(`corrupt`): it is recomputed, as every failed load is; only verified rows become tier
entries. The thread reads the next chunk while the copy runs, lets go of the pages behind
a copy once its event has passed, and returns only when every copy has ended: a finished
task means the KV is in place, and a cancelled request's blocks stay pinned until its
copies end.

Save (begun on the executing thread right after the forward, finished on an I/O thread):
a side stream waits for the forward, gathers the chunk's blocks into a device staging
buffer and copies it into a page in one device-to-host copy; an I/O thread waits for that
copy's event and writes the files from the page. The forward never waits for a save
(only if every page of the tier is held does the executing thread wait for one).

No wait for a page can wait on itself: a load task lets go of every page it holds before
it waits, and the tasks that finish saves run on threads of their own that never wait
for a page, so pages held by saves always come back.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from shoal.connectors.store import gpu_place, gpu_xxh3
from shoal.connectors.store.host_tier import HostTier

IN_FLIGHT_CHUNKS = 2  # a load task's chunks whose copies may run while it reads the next
SLOTS = IN_FLIGHT_CHUNKS + 2  # a thread's pinned slots for chunks' small inputs (_slot)
# the longest a chunk read from files waits with its copies and checks while the executing
# thread launches a forward (0: never waits)
LAUNCH_WAIT_S = 0.05
# the I/O threads wait for their copies asleep (an event made with cudaEventBlockingSync),
# not spinning in the driver beside the executing thread as it launches a forward
BLOCKING_WAITS = True

# (block index in the task, dest) -> the header's checksum of what was read into dest, or
# None if the block is not usable (verified already unless the mover `verifies`)
ReadFn = Callable[[int, memoryview], "int | None"]
# (block indices in the task, page, first slot) -> read's value of each, read into the
# page's slots from the first: a chunk's reads in one call (None: not taken, `read` each)
ReadManyFn = Callable[[list[int], int, int], "list[int | None] | None"]
CorruptFn = Callable[[int], None]  # (block index in the task): it failed the GPU's check
WriteFn = Callable[[int, memoryview], bool]  # (block index in the task, bytes) -> published


class PagedMover:
    def __init__(self, kv: torch.Tensor, tier: HostTier):
        # blocks as rows of 8-byte words (bytes if a block is not a whole number of words):
        # the gathers and scatters move 8 bytes per element
        self.word = torch.int64 if tier.block_nbytes % 8 == 0 else torch.uint8
        self.kv_rows = kv.reshape(kv.shape[0], -1).view(torch.uint8).view(self.word)
        assert self.kv_rows.numel() * self.kv_rows.element_size() == kv.numel() * kv.element_size()
        self.tier = tier
        self.device = kv.device
        self.is_cuda = kv.is_cuda
        # the GPU checks what is read (the reads then skip the CPU's hash)
        self.verifies = (self.is_cuda and gpu_xxh3.available()
                         and gpu_xxh3.supports(tier.block_nbytes))
        self._local = threading.local()  # per thread: its stream and device staging
        self._not_launching = threading.Event()  # cleared while a forward is launched
        self._not_launching.set()

    # -- loads (I/O threads) --------------------------------------------------------------

    def launching(self, now: bool) -> None:
        """The executing thread launches a forward (True) or is done (False). Meanwhile a
        chunk read from files holds its copies back (at most LAUNCH_WAIT_S): each of their
        calls takes the GIL back (8 I/O threads stretched an 8B launch 20 -> 75-160 ms)."""
        if now:
            self._not_launching.clear()
        else:
            self._not_launching.set()

    def fence(self) -> torch.cuda.Event | None:
        """An event after the work launched so far on the calling thread's stream (before a
        step's forward): the copies of the loads started now wait for it (`load`'s `after`),
        as blocks just handed to a load may still be in use by those steps (a request
        preempted mid-step frees its blocks at once); later forwards never touch them."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def load(self, keys: list[bytes], block_ids: list[int], read: ReadFn,
             corrupt: CorruptFn, after: torch.cuda.Event | None = None,
             read_many: ReadManyFn | None = None) -> None:
        """Bring blocks `keys[i]` into KV block `block_ids[i]`; `read(i, dest)` reads block
        i's file into `dest` (None: not usable, left as is), unless `read_many` reads the
        chunk; the copies wait for `after` (a `fence`; None: all work launched so far). If
        the mover `verifies`, the GPU checks each read block against read's checksum and
        calls `corrupt(i)` for one that fails. Returns once every copy has ended."""
        if self._copy_hits(keys, block_ids, after):
            return
        per = self.tier.blocks_per_page
        in_flight: deque[_Chunk] = deque()
        read_chunk = _chunk_reader(read, read_many, self.tier)
        try:
            for first in range(0, len(keys), per):
                in_flight.append(self._load_chunk(keys[first:first + per],
                                                  block_ids[first:first + per], read_chunk,
                                                  first, in_flight, corrupt, after))
                while len(in_flight) > IN_FLIGHT_CHUNKS:
                    self._finish(in_flight.popleft(), corrupt)
        finally:
            self._finish_all(in_flight, corrupt)

    def _copy_hits(self, keys: list[bytes], block_ids: list[int],
                   after: torch.cuda.Event | None) -> bool:
        """If the tier holds every one of `keys` (in at most 3/4 of its pages, in runs of
        consecutive slots going to consecutive blocks no more than the pages or a quarter of
        the blocks): copy each run straight into its KV blocks, all at once, and return True
        once the copies have ended (else False, having done nothing). Nothing is staged
        (tier entries are verified): staging a page at a time ran at 0.8 of a pinned copy."""
        where = self.tier.locate(keys)  # (no hold, no hit counted)
        if None in where:
            return False
        runs, num_pages = _runs(sorted(zip(where, block_ids))), len({p for p, _ in where})
        if num_pages > 3 * self.tier.num_pages // 4 or len(runs) > max(num_pages, len(keys) // 4):
            return False  # (too much of the tier held at once; too many short copies)
        found, pages, misses = self._find(keys)
        stream = None
        try:
            if misses or found != where:  # (a page emptied since)
                return False
            if self.is_cuda:
                stream = self._thread_buffers()[0]
                self._after(stream, after)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for page, slot, block, count in runs:
                    self.kv_rows[block:block + count].copy_(
                        self.tier.rows(page, slot, count).view(self.word), non_blocking=True)
            return True
        finally:  # the pages are let go of once no copy may read them
            try:
                if stream is not None:
                    _wait(stream)
            finally:
                for page in pages:
                    self.tier.release(page)

    def _finish_all(self, in_flight: deque, corrupt: CorruptFn) -> None:
        """Finish every chunk in flight, even after one raised; then raise the first error."""
        error = None
        while in_flight:
            try:
                self._finish(in_flight.popleft(), corrupt)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error

    def _load_chunk(self, keys, block_ids, read: ReadManyFn, offset: int, in_flight: deque,
                    corrupt: CorruptFn, after: torch.cuda.Event | None) -> _Chunk:
        tier = self.tier
        where, pages, misses = self._find(keys)
        try:
            to_check: list[tuple[int, int]] = []  # (index in the chunk, checksum)
            if misses:
                page = tier.take_page(wait=False)
                if page is None:  # every page held: let go of all of ours, wait for one
                    while pages:
                        tier.release(pages.pop())
                    self._finish_all(in_flight, corrupt)
                    page = tier.take_page()
                    pages.append(page)
                    where, hits, misses = self._find(keys)
                    pages.extend(hits)
                else:
                    pages.append(page)
                checksums = read([offset + i for i in misses], page, 0)
                for slot, (i, checksum) in enumerate(zip(misses, checksums)):
                    if checksum is None:
                        continue
                    where[i] = (page, slot)
                    if self.verifies:
                        to_check.append((i, checksum))
                    else:
                        tier.publish(page, slot, keys[i])
            rows = [(w, b) for w, b in zip(where, block_ids) if w is not None]
            if misses and self.is_cuda:
                self._not_launching.wait(LAUNCH_WAIT_S)
            checks = []  # (place among rows, checksum) of the rows read from files
            if to_check:
                read_or_hit = (i for i, w in enumerate(where) if w is not None)
                place = {i: n for n, i in enumerate(read_or_hit)}
                checks = [(place[i], c) for i, c in to_check]
            event, verdicts = self._copy_in(rows, checks, after)
            return _Chunk(event, pages, [(offset + i, keys[i], where[i]) for i, _ in to_check],
                          verdicts)
        except BaseException:  # let go of the pages held, once no copy may read them
            if self.is_cuda:
                _wait(self._thread_buffers()[0])
            for page in pages:
                tier.release(page)
            raise

    def _find(self, keys: list[bytes]):
        """The tier's slots of `keys` (None: not there), the hits' pages held, the misses."""
        where = self.tier.find(keys)
        return (where, [w[0] for w in where if w is not None],
                [i for i, w in enumerate(where) if w is None])

    def _copy_in(self, rows: list[tuple[tuple[int, int], int]], checks: list[tuple[int, int]],
                 after: torch.cuda.Event | None
                 ) -> tuple[torch.cuda.Event | None, torch.Tensor | None]:
        """Copy tier slots into KV blocks: [((page, slot), block id)], after `after` (see
        `load`); checks: (place in rows, checksum) of the rows the GPU verifies. Returns
        the copies' event and, for the checks, a pinned int8 tensor (1: verified) that is
        valid once the event is."""
        if not rows:
            return None, None
        if not self.is_cuda:
            for (page, slot), block in rows:
                self.kv_rows[block].copy_(self.tier.rows(page, slot, 1)[0].view(self.word))
            return None, None
        stream, staging = self._thread_buffers()
        host, host_ok = self._slot()
        with torch.cuda.stream(stream):
            self._after(stream, after)
            for page, first, row, count in _runs((w, i) for i, (w, _) in enumerate(rows)):
                staging[row:row + count].copy_(self.tier.rows(page, first, count).view(self.word),
                                               non_blocking=True)
            values, spans = gpu_place.pack([b for _, b in rows], checks)
            host.numpy()[:len(values)] = values
            ids = host[:len(values)].to(self.device, non_blocking=True)
            targets, places, sums, of_row = (ids[at:at + k] for at, k in spans)
            verdicts = None
            if checks:  # a row that failed keeps its block's bytes
                _, ok = gpu_xxh3.verify_rows(staging, places, sums)
                verdicts = host_ok[:len(checks)]
                verdicts.copy_(ok, non_blocking=True)
                gpu_place.place_rows(self.kv_rows, staging, targets, of_row, ok)
            else:
                self.kv_rows.index_copy_(0, targets, staging[:len(rows)])
            event = _event()
            event.record(stream)
        return event, verdicts

    def _after(self, stream: torch.cuda.Stream, after: torch.cuda.Event | None) -> None:
        """`stream` waits for `after`, or (None) for the forwards launched so far (on the
        default stream, this thread's too)."""
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def _finish(self, chunk: _Chunk, corrupt: CorruptFn) -> None:
        """Wait for a chunk's copies; publish its verified rows to the tier and report
        the others to `corrupt`."""
        try:
            if chunk.event is not None:
                chunk.event.synchronize()
            if chunk.checks:
                for (index, key, (page, slot)), ok in zip(chunk.checks, chunk.verdicts.tolist()):
                    if ok:
                        self.tier.publish(page, slot, key)
                    else:
                        corrupt(index)
        finally:
            for page in chunk.pages:
                self.tier.release(page)

    # -- saves (begun on the executing thread, finished on an I/O thread) ----------------

    def begin_save(self, block_ids: list[int]) -> tuple[int, torch.cuda.Event | None]:
        """Copy up to one page of KV blocks into a fresh page, after the work queued so far
        on this thread's stream (the forward that computed them). Returns the page (held:
        `finish_save` lets go of it) and the copy's event (None on a CPU)."""
        assert len(block_ids) <= self.tier.blocks_per_page, len(block_ids)
        page = self.tier.take_page()
        rows = self.tier.rows(page, 0, len(block_ids))
        if not self.is_cuda:
            torch.index_select(self.kv_rows, 0, torch.tensor(block_ids, dtype=torch.long),
                               out=rows.view(self.word))
            return page, None
        compute = torch.cuda.current_stream(self.device)
        stream, staging = self._thread_buffers()
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)
            ids = torch.tensor(block_ids, dtype=torch.long).pin_memory()  # (pageable: waits)
            torch.index_select(self.kv_rows, 0, ids.to(self.device, non_blocking=True),
                               out=staging[:len(block_ids)])
            rows.view(self.word).copy_(staging[:len(block_ids)], non_blocking=True)
            event = _event()
            event.record(stream)
        return page, event

    def finish_save(self, page: int, event: torch.cuda.Event | None, keys: list[bytes],
                    write: WriteFn, offset: int = 0) -> None:
        """Wait for the page's copy, write its blocks (`write(offset + i, bytes)`), keep the
        ones written or already in the pool as tier entries, let go of the page."""
        try:
            if event is not None:
                event.synchronize()
            slots = self.tier.rows(page, 0, len(keys)).numpy()
            for slot, key in enumerate(keys):
                if write(offset + slot, memoryview(slots[slot])):
                    self.tier.publish(page, slot, key)
        finally:
            self.tier.release(page)

    def prepare_thread(self) -> None:
        """Make this thread's stream, staging and pinned slots now (not in a first load)."""
        self._thread_buffers()
        self._slot()

    def warm_up(self) -> None:
        """Compile the GPU check and placement at bring-up, not in a first load (~0.5 s)."""
        if self.verifies:
            row = torch.zeros((1, self.kv_rows.shape[1]), dtype=torch.int64, device=self.device)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            _, ok = gpu_xxh3.verify_rows(row, zero, zero)
            gpu_place.place_rows(row, row, zero, zero - 1, ok)  # (row 0 onto itself)
            torch.cuda.synchronize(self.device)

    def _thread_buffers(self) -> tuple[torch.cuda.Stream, torch.Tensor]:
        """This thread's side stream and page-sized device staging buffer (made on it)."""
        local = self._local
        if getattr(local, "stream", None) is None:
            local.stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(local.stream):
                local.staging = torch.empty((self.tier.blocks_per_page, self.tier.block_nbytes),
                                            dtype=torch.uint8, device=self.device).view(self.word)
        return local.stream, local.staging

    def _slot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's next pinned slot for a chunk's ids and checks (int64) and verdicts
        (int8), used in turn: a slot's last chunk has finished when it is used again."""
        local = self._local
        if getattr(local, "inputs", None) is None:
            per = self.tier.blocks_per_page
            local.inputs = torch.empty((SLOTS, 4 * per + 4), dtype=torch.long, pin_memory=True)
            local.verdicts = torch.empty((SLOTS, per), dtype=torch.int8, pin_memory=True)
            local.turn = 0
        local.turn = (local.turn + 1) % SLOTS
        return local.inputs[local.turn], local.verdicts[local.turn]


@dataclass
class _Chunk:
    """A load chunk in flight: its copies' event, the pages it holds, and the rows the GPU
    verifies ((index in the task, key, (page, slot)); their verdicts once the event is)."""

    event: torch.cuda.Event | None
    pages: list[int]
    checks: list[tuple[int, bytes, tuple[int, int]]]
    verdicts: torch.Tensor | None


def _event() -> torch.cuda.Event:  # one an I/O thread waits for (letting go of the GIL)
    return torch.cuda.Event(blocking=BLOCKING_WAITS)


def _wait(stream: torch.cuda.Stream) -> None:  # for the work queued so far on `stream`
    event = _event()
    event.record(stream)
    event.synchronize()


def _chunk_reader(read: ReadFn, read_many: ReadManyFn | None, tier: HostTier) -> ReadManyFn:
    """A chunk's reads: by `read_many` where it takes them, else block by block by `read`."""
    def read_chunk(indices: list[int], page: int, first: int) -> list[int | None]:
        if read_many is not None and (sums := read_many(indices, page, first)) is not None:
            return sums
        slots = tier.rows(page, first, len(indices)).numpy()
        return [read(i, memoryview(slots[j])) for j, i in enumerate(indices)]
    return read_chunk


def _runs(pairs) -> list[tuple[int, int, int, int]]:
    """(page, first slot, first target, count) of each run of consecutive slots going to
    consecutive targets, of ((page, slot), target) pairs in the order given (sorted: every
    run, as a load lists its blocks last first; in staging order: its rows)."""
    runs: list[list[int]] = []
    for (page, slot), target in pairs:
        if (runs and runs[-1][0] == page and runs[-1][1] + runs[-1][3] == slot
                and runs[-1][2] + runs[-1][3] == target):
            runs[-1][3] += 1
        else:
            runs.append([page, slot, target, 1])
    return [tuple(r) for r in runs]
