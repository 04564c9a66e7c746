"""Host memory between the pool's files and a GPU's KV cache, kept as a cache of blocks.

A slab of pages (pinned when the KV cache is on a GPU); a page is `blocks_per_page`
consecutive block-sized slots, so the blocks one I/O task reads or saves together move
to or from the GPU with one large copy. Every load and save passes through a page:

- a load reads its block files into a page's slots, verifies them there and copies the
  page to the GPU; a save copies blocks from the GPU into a page and writes the files
  from it;
- verified (loaded) and saved blocks stay in their slots after the transfer, keyed by
  their pool key: a later load of the same key copies from the slot and reads no file.

Pages are the unit of reuse: the least recently used page that no transfer holds is
emptied (all its keys forgotten) and handed out whole. A page is held (pinned) from
`take_page` or a `find` hit until `release`; a held page is never emptied, so its slots
stay valid for the copies of the transfer holding it. The files stay the shared,
persistent truth: the tier is one process's copy and forgets nothing a file does not
still have (a key is only found here if the scheduler found its file first).

A `shared` slab lives in a memfd (`fd`) that other processes map: the fs pool's read
processes read block files straight into its slots (fs/read_procs.py). Pinned, it is
registered with CUDA (cudaHostRegister) rather than allocated by it.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict

import torch

PAGE_BYTES = 16 << 20  # a page's size, roughly: large copies, and a fine grain for the LRU


MIN_PAGES = 8  # a small tier is cut into smaller pages rather than fewer


def tier_shape(tier_bytes: int, block_nbytes: int, min_pages: int = 0) -> tuple[int, int]:
    """(pages, blocks per page) of a tier of about `tier_bytes`, with at least `min_pages`
    pages when that is above 0 (pages stage copies even when nothing is to be kept)."""
    per_page = max(1, PAGE_BYTES // block_nbytes)
    if tier_bytes:
        per_page = max(1, min(per_page, tier_bytes // (MIN_PAGES * block_nbytes)))
    return max(tier_bytes // (per_page * block_nbytes), min_pages), per_page


class HostTier:
    def __init__(self, block_nbytes: int, num_pages: int, blocks_per_page: int, pinned: bool,
                 shared: bool = False):
        assert num_pages > 0 and blocks_per_page > 0, (num_pages, blocks_per_page)
        self.block_nbytes = block_nbytes
        self.blocks_per_page = blocks_per_page
        self.num_pages = num_pages
        shape = (num_pages * blocks_per_page, block_nbytes)
        self.fd: int | None = None  # the shared slab's memfd
        self._registered = False
        if shared:
            self.fd = os.memfd_create("shoal-host-tier", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, shape[0] * shape[1])
            self.slab = torch.frombuffer(mmap.mmap(self.fd, shape[0] * shape[1]),
                                         dtype=torch.uint8).view(shape)
            if pinned:
                error = torch.cuda.cudart().cudaHostRegister(self.slab.data_ptr(),
                                                             self.slab.numel(), 0)
                if int(error) != 0:
                    self.close()
                    raise RuntimeError(f"cudaHostRegister of the host tier failed ({error})")
                self._registered = True
        else:
            self.slab = torch.empty(shape, dtype=torch.uint8, pin_memory=pinned)
        self._keys: list[list[bytes | None]] = [[None] * blocks_per_page for _ in range(num_pages)]
        self._pins = [0] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self._where: dict[bytes, tuple[int, int]] = {}  # key -> (page, slot)
        self._cond = threading.Condition()
        self.num_hits = 0

    def close(self) -> None:
        """Let go of a shared slab's registration and memfd (the slab itself goes with the
        last tensor viewing it)."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.slab.data_ptr())
            self._registered = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def row(self, page: int, slot: int) -> int:
        """The slab row of a page's slot."""
        return page * self.blocks_per_page + slot

    def rows(self, page: int, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Slots [first, first + count) of a page: a [count, block_nbytes] uint8 view."""
        start = self.row(page, first)
        return self.slab[start:start + (self.blocks_per_page - first if count is None else count)]

    def take_page(self, wait: bool = True) -> int | None:
        """An empty page, held by the caller: the least recently used page nobody holds,
        its keys forgotten. While every page is held: wait (a caller must hold none then,
        or it may wait on itself), or return None if not `wait`."""
        with self._cond:
            while not self._idle:
                if not wait:
                    return None
                self._cond.wait()
            page, _ = self._idle.popitem(last=False)
            keys = self._keys[page]
            for slot, key in enumerate(keys):
                if key is not None and self._where.get(key) == (page, slot):
                    del self._where[key]
                keys[slot] = None
            self._pins[page] = 1
            return page

    def find(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        """(page, slot) of each key held here, or None; every page found is held once per
        hit (release it as often)."""
        out = []
        with self._cond:
            for key in keys:
                where = self._where.get(key)
                if where is not None:
                    self._hold(where[0])
                    self.num_hits += 1
                out.append(where)
        return out

    def contains(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is held here now (nothing is held for the caller: a page may be
        emptied before the caller's `find`)."""
        return [where is not None for where in self.locate(keys)]

    def locate(self, keys: list[bytes]) -> list[tuple[int, int] | None]:
        """(page, slot) of each key held here now, or None: as `find`, but nothing is held
        (or counted as a hit) for the caller."""
        with self._cond:
            return [self._where.get(key) for key in keys]

    def publish(self, page: int, slot: int, key: bytes) -> None:
        """The slot holds `key`'s verified bytes (the caller holds the page)."""
        with self._cond:
            assert self._pins[page] > 0, f"publishing into page {page}, which nobody holds"
            self._keys[page][slot] = key
            self._where.setdefault(key, (page, slot))

    def release(self, page: int) -> None:
        """Drop one hold; a page nobody holds becomes the most recently used idle page."""
        with self._cond:
            assert self._pins[page] > 0, f"page {page} released more often than held"
            self._pins[page] -= 1
            if self._pins[page] == 0:
                self._idle[page] = None
                self._cond.notify()

    def _hold(self, page: int) -> None:
        if self._pins[page] == 0:
            del self._idle[page]
        self._pins[page] += 1

    @property
    def num_held_pages(self) -> int:
        with self._cond:
            return self.num_pages - len(self._idle)

    def check_integrity(self) -> None:
        with self._cond:
            for page in range(self.num_pages):
                assert (self._pins[page] == 0) == (page in self._idle), (
                    f"page {page}: {self._pins[page]} holds, idle={page in self._idle}")
            for key, (page, slot) in self._where.items():
                assert self._keys[page][slot] == key, f"key of page {page} slot {slot} differs"
