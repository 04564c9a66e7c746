"""A step's inputs: its host arrays, built in one place for every path, and their copy.

`StepRows.of` builds them with numpy over the whole batch. The eager forward sends them in
one non-blocking copy from a pinned buffer (`StepInputs`; the buffers alternate, as a step
launches before the last one finished: shoal.util.HostBuffers); a CUDA graph copies them
into its padded layout. See docs/design.md, "Attention on a GPU".
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain
from operator import attrgetter

import numpy as np
import torch

from shoal.engine.table_rows import TableRows
from shoal.util import HostBuffers, cdiv

ALIGN = 16  # int32 elements: 64 bytes
# the chunk fields StepRows.of reads whole (C loops: no Python per chunk)
_FIELDS = (("start", np.int32), ("num_tokens", np.int32), ("num_placeholders", np.int32),
           ("is_sampling", np.bool_))


def aligned_starts(sizes) -> list[int]:
    """Where each of vectors of these sizes starts in one int32 buffer, each on a 64-byte
    boundary, and (last) the buffer's size."""
    return [0, *accumulate(cdiv(n, ALIGN) * ALIGN for n in sizes)]


@dataclass(slots=True)
class StepRows:
    """One step's host arrays (int32), rows in chunk order."""

    ids: np.ndarray  # [T] token ids; a placeholder (the step in flight samples it) as 0
    positions: np.ndarray  # [T]
    slot_blocks: np.ndarray  # [T] the block holding each position's KV slot
    slot_offsets: np.ndarray  # [T] the slot's offset in that block
    starts: np.ndarray  # [S] each chunk's first row
    lens: np.ndarray  # [S] its rows
    ctxs: np.ndarray  # [S] its request's tokens with KV after the step
    sample_rows: np.ndarray  # the rows sampled (a sampling chunk's last)
    fill_rows: np.ndarray  # the placeholder rows (a chunk's last) ...
    sources: np.ndarray  # ... and their tokens' rows in the previous step's samples
    table_rows: np.ndarray  # [S] each chunk's row of the kept block table
    table_indices: np.ndarray  # the kept table's flat entries this step writes ...
    table_values: np.ndarray  # ... and their block ids

    @classmethod
    def of(cls, chunks, block_size: int, prev_rows: dict[str, int], table: TableRows) -> StepRows:
        """The arrays of `chunks` (ScheduledChunk). `prev_rows`: each request's row in the
        previous step's samples (a placeholder is its request's last sample). Places the
        chunks' rows in `table`: the caller writes table_indices / table_values to it first."""
        n, i32 = len(chunks), np.int32
        first, lens, holes, sampling = (np.fromiter(map(attrgetter(name), chunks), dtype, n)
                                        for name, dtype in _FIELDS)
        ends = np.cumsum(lens, dtype=i32)
        starts, ctxs = ends - lens, first + lens
        if n == 0 or ends[-1] == n:  # decodes (and one-token chunks) only: a row each
            positions = first
            slot_blocks = np.fromiter((c.block_ids[c.start // block_size] for c in chunks), i32, n)
            ids = np.fromiter((c.token_ids[0] if c.token_ids else 0 for c in chunks), i32, n)
        else:
            in_chunk = np.arange(ends[-1], dtype=i32) - np.repeat(starts, lens)
            positions = np.repeat(first, lens) + in_chunk
            # each chunk's own blocks side by side; a row's block is among its chunk's
            low, high = first // block_size, (ctxs - 1) // block_size + 1
            counts = high - low
            own = np.fromiter(chain.from_iterable(c.block_ids[a:b] for c, a, b in zip(
                chunks, low.tolist(), high.tolist())), i32, int(counts.sum()))
            own_start = np.cumsum(counts) - counts
            slot_blocks = own[np.repeat(own_start - low, lens) + positions // block_size]
            ids = np.zeros(ends[-1], i32)
            ids[in_chunk < np.repeat(lens - holes, lens)] = np.fromiter(
                chain.from_iterable(c.token_ids for c in chunks), i32)
        assert holes.max(initial=0) <= 1, "a chunk with more than one placeholder"
        sources = [prev_rows[c.request.request_id] for c in chunks if c.num_placeholders]
        rows, indices, values = table.place(chunks, block_size)
        return cls(ids, positions, slot_blocks, positions % block_size, starts, lens, ctxs,
                   (ends - 1)[sampling], (ends - 1)[holes > 0], np.asarray(sources, i32),
                   np.asarray(rows, i32), np.asarray(indices, i32), np.asarray(values, i32))


class StepInputs:
    def __init__(self, device: torch.device):
        self.device = device
        self._host = HostBuffers(0, device)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device int32 views of `arrays` (1-D or 2-D), sent in one copy. Each view starts
        on a 64-byte boundary: Triton specializes a kernel on its pointers' alignment, and a
        view at a step-dependent offset would compile new variants mid-request."""
        *starts, total = aligned_starts(a.size for a in arrays)
        if total > self._host.size:
            size = max(total, 2 * self._host.size, 1 << 16)
            if self._host.cuda:  # the old buffers' last copies
                torch.cuda.synchronize(self.device)
            self._host = HostBuffers(size, self.device)
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device)
        pinned = self._host.take()
        host = pinned.numpy()
        for a, start in zip(arrays, starts):
            host[start:start + a.size] = a.reshape(-1)
        self._dev[:total].copy_(pinned[:total], non_blocking=True)
        self._host.sent()
        return [self._dev[start:start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
