"""Block-table rows kept from step to step (the persistent part of the batch layout).

A running request keeps one row of a device table, written whole when it joins or its
block list was replaced (a list is only ever appended to while held: ScheduledChunk), then
only where it gained a block. A step's table is one device gather of its rows (the
runner's, or a CUDA graph's first op): docs/design.md, "Attention on a GPU".

    rows    | r0: a's blocks | r1: (free) | r2: b's blocks | ...     `table`, on the device
    step    a at row 0, b at row 2  ->  the step's table = table[[0, 2]]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Row:
    index: int
    blocks: list[int]  # the request's block list these entries came from (held: never reused)
    written: int = 0  # entries [0, written) of the row are blocks[0:written]


class TableRows:
    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.num_rows = num_rows
        self.width = width
        self.table = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def place(self, chunks, block_size: int) -> tuple[list[int], list[int], list[int]]:
        """(each chunk's row, in order; the flat `table` indices to write and their block
        ids) for a batch of at most num_rows chunks: what a row lacks up to the block
        holding the chunk's last position."""
        if len(self._rows) + len(chunks) > self.num_rows:  # rows of requests not here go
            here = {c.request.request_id for c in chunks}
            for rid in [r for r in self._rows if r not in here]:
                self.release(rid)
        rows, indices, values = [], [], []
        for c in chunks:
            row = self._rows.get(c.request.request_id)
            if row is None:
                row = self._rows[c.request.request_id] = _Row(self._free.pop(), c.block_ids)
            elif row.blocks is not c.block_ids:  # a new list: the old entries are stale
                row.blocks, row.written = c.block_ids, 0
            need = (c.start + c.num_tokens - 1) // block_size + 1
            assert need <= self.width, f"{c.request.request_id}: {need} blocks > {self.width}"
            if need > row.written:
                base = row.index * self.width
                indices.extend(range(base + row.written, base + need))
                values.extend(c.block_ids[row.written:need])
                row.written = need
            rows.append(row.index)
        return rows, indices, values

    def write(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Apply `place`'s writes, sent to the device (int32 flat indices, block ids)."""
        self.table.view(-1)[indices.long()] = values

    def release(self, request_id: str) -> None:
        """The request's row is free again (it finished, or left the decode batch for good)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.index)

    def check_integrity(self, held_by: set[str] | None = None) -> None:
        """Every held row's written entries equal its request's blocks (reads the device);
        only requests in `held_by` (if given) hold rows."""
        assert held_by is None or set(self._rows) <= held_by, set(self._rows) - held_by
        table = self.table.cpu()
        for rid, row in self._rows.items():
            assert table[row.index, :row.written].tolist() == row.blocks[:row.written], rid
        assert len(self._rows) + len(self._free) == self.num_rows
