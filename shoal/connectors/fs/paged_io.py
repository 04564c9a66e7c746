"""Moving blocks between the pool's files and the KV cache through host-tier pages.

The path for a KV cache on a GPU (and for a CPU cache when a host tier is configured).
Blocks move a chunk at a time, a chunk being up to one page of blocks:

Load (on an I/O thread): the chunk's blocks held by the tier are found there; the others
are read from their files into the slots of a fresh page and verified there (checksums
off the GIL: the I/O threads verify in parallel). Then, on the thread's own CUDA stream,
each run of consecutive slots goes to a device staging buffer in one host-to-device
copy, and one `index_copy_` places the rows into their KV blocks; an event marks the end.
The thread reads the next chunk while the copy runs, waits for an event before it lets
go of the pages behind it, and returns only when every copy has ended: a finished task
means the KV is in place (the engine's poll stays a `Future.done()`), and a cancelled
request's blocks stay pinned until its copies end.

Save (started on the executing thread right after the forward, finished on an I/O
thread): a side stream waits for the forward, gathers the chunk's blocks into a device
staging buffer and copies it into a page in one device-to-host copy; an I/O thread waits
for that copy's event and writes the files from the page. The forward never waits for a
save (only if every page of the tier is held does the executing thread wait for one).

No wait for a page can wait on itself: a load task lets go of every page it holds before
it waits, and the tasks that finish saves run on threads of their own that never wait
for a page, so pages held by saves always come back.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

import torch

from shoal.connectors.fs.host_tier import HostTier

IN_FLIGHT_CHUNKS = 2  # a load task's chunks whose copies may run while it reads the next

ReadFn = Callable[[int, memoryview], bool]  # (block index in the task, dest) -> verified
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
        self._local = threading.local()  # per thread: its stream and device staging

    # -- loads (I/O threads) --------------------------------------------------------------

    def load(self, keys: list[bytes], block_ids: list[int], read: ReadFn) -> None:
        """Bring blocks `keys[i]` into KV block `block_ids[i]`; `read(i, dest)` reads and
        verifies block i's file into `dest` (False: not usable, the block is left as is).
        Returns once every copy has ended."""
        per = self.tier.blocks_per_page
        in_flight: deque[tuple[torch.cuda.Event | None, list[int]]] = deque()
        try:
            for first in range(0, len(keys), per):
                in_flight.append(self._load_chunk(keys[first:first + per],
                                                  block_ids[first:first + per], read, first,
                                                  in_flight))
                while len(in_flight) > IN_FLIGHT_CHUNKS:
                    self._finish(*in_flight.popleft())
        finally:
            while in_flight:
                self._finish(*in_flight.popleft())

    def _load_chunk(self, keys, block_ids, read: ReadFn, offset: int, in_flight: deque):
        tier = self.tier
        where, pages, misses = self._find(keys)
        if misses:
            page = tier.take_page(wait=False)
            if page is None:  # every page held: let go of all of ours, then wait for one
                for held in pages:
                    tier.release(held)
                while in_flight:
                    self._finish(*in_flight.popleft())
                page = tier.take_page()
                where, pages, misses = self._find(keys)
            pages.append(page)
            slots = tier.rows(page, 0, len(misses)).numpy()
            for slot, i in enumerate(misses):
                if read(offset + i, memoryview(slots[slot])):
                    tier.publish(page, slot, keys[i])
                    where[i] = (page, slot)
        rows = [(w, b) for w, b in zip(where, block_ids) if w is not None]
        return self._copy_in(rows), pages

    def _find(self, keys: list[bytes]):
        """The tier's slots of `keys` (None: not there), the pages held for the hits (one
        hold each), and the indices of the misses."""
        where = self.tier.find(keys)
        return (where, [w[0] for w in where if w is not None],
                [i for i, w in enumerate(where) if w is None])

    def _copy_in(self, rows: list[tuple[tuple[int, int], int]]) -> torch.cuda.Event | None:
        """Copy tier slots into KV blocks: [((page, slot), block id)]."""
        if not rows:
            return None
        if not self.is_cuda:
            for (page, slot), block in rows:
                self.kv_rows[block].copy_(self.tier.rows(page, slot, 1)[0].view(self.word))
            return None
        # after the forwards launched so far (on the default stream, which is this thread's
        # current one): one may still use these blocks' previous contents (a request
        # preempted while its last step runs frees its blocks at once)
        compute = torch.cuda.current_stream(self.device)
        stream, staging = self._thread_buffers()
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)
            n = 0
            for page, first, count in _runs([w for w, _ in rows]):
                staging[n:n + count].copy_(self.tier.rows(page, first, count).view(self.word),
                                           non_blocking=True)
                n += count
            self.kv_rows.index_copy_(0, self._to_device([b for _, b in rows]), staging[:n])
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _finish(self, event: torch.cuda.Event | None, pages: list[int]) -> None:
        if event is not None:
            event.synchronize()  # releases the GIL while it waits
        for page in pages:
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
            torch.index_select(self.kv_rows, 0, self._to_device(block_ids),
                               out=staging[:len(block_ids)])
            rows.view(self.word).copy_(staging[:len(block_ids)], non_blocking=True)
            event = torch.cuda.Event()
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

    def _to_device(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the GPU without a host wait: from pinned memory, which the host
        allocator keeps until the copy has run (a copy from pageable memory would make
        the host wait for everything queued on the stream)."""
        ids = torch.tensor(block_ids, dtype=torch.long).pin_memory()
        return ids.to(self.device, non_blocking=True)

    def prepare_thread(self) -> None:
        """Make this thread's stream and staging buffer now (else at its first copy)."""
        self._thread_buffers()

    def _thread_buffers(self) -> tuple[torch.cuda.Stream, torch.Tensor]:
        """This thread's side stream and a page-sized device staging buffer (made once,
        on that stream: every use of it is ordered on the stream)."""
        local = self._local
        if getattr(local, "stream", None) is None:
            local.stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(local.stream):
                local.staging = torch.empty((self.tier.blocks_per_page, self.tier.block_nbytes),
                                            dtype=torch.uint8, device=self.device).view(self.word)
        return local.stream, local.staging


def _runs(where: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(page, first slot, count) of each run of consecutive slots, in order."""
    runs: list[list[int]] = []
    for page, slot in where:
        if runs and runs[-1][0] == page and runs[-1][1] + runs[-1][2] == slot:
            runs[-1][2] += 1
        else:
            runs.append([page, slot, 1])
    return [tuple(r) for r in runs]
