"""Saves through host-tier pages (the save side of paged_io.PagedMover).

Save (begun on the executing thread right after the forward, finished on an I/O thread):
a side stream waits for the forward, gathers the chunk's blocks into a device staging
buffer and copies it into a page in one device-to-host copy; an I/O thread waits for that
copy's event and writes the files from the page. The forward never waits for a save
(only if every page of the tier is held does the executing thread wait for one).
"""

from __future__ import annotations

from typing import Callable

import torch

WriteFn = Callable[[int, memoryview], bool]  # (block index in the task, bytes) -> published


class PagedSaves:
    """PagedMover's saves (they use its tier, KV rows, streams and staging buffers)."""

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
            event = self._new_event()
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
