"""TableRows: block-table rows kept from step to step for the CUDA graphs and eager steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.table_rows import TableRows

BS = 4


@dataclass
class _Req:
    request_id: str


@dataclass
class _Chunk:  # the fields of a ScheduledChunk that TableRows reads
    request: _Req
    start: int
    block_ids: list[int]
    num_tokens: int = 1


def _step(rows: TableRows, chunks) -> tuple[list[int], int]:
    """Place a decode batch and apply its writes as the graphs do; (its rows, entries written)."""
    placed, indices, values = rows.place(chunks, BS)
    rows.write(torch.tensor(indices, dtype=torch.int32), torch.tensor(values, dtype=torch.int32))
    for row, c in zip(placed, chunks):  # what the step gathers: the chunk's blocks so far
        need = (c.start + c.num_tokens - 1) // BS + 1
        assert rows.table[row, :need].tolist() == c.block_ids[:need]
    return placed, len(indices)


def test_only_new_blocks_are_written_and_rows_stay():
    rows = TableRows(4, 8, torch.device("cpu"))
    a, b = _Req("a"), _Req("b")
    blocks_a, blocks_b = [7, 3], [5]
    placed, written = _step(rows, [_Chunk(a, 5, blocks_a), _Chunk(b, 0, blocks_b)])
    assert written == 3 and placed[0] != placed[1]
    # a's next tokens in the same block: nothing to write; order in the batch may change
    again, written = _step(rows, [_Chunk(b, 1, blocks_b), _Chunk(a, 6, blocks_a)])
    assert written == 0 and again == placed[::-1]
    blocks_a.append(9)  # a crosses into a new block: one entry
    _, written = _step(rows, [_Chunk(a, 8, blocks_a)])
    assert written == 1
    blocks_b.extend([2, 8])  # a chunk of 7 tokens at positions 1-7: b's second block
    _, written = _step(rows, [_Chunk(b, 1, blocks_b, num_tokens=7)])
    assert written == 1
    rows.check_integrity()


def test_a_replaced_block_list_rewrites_the_row():
    rows = TableRows(2, 8, torch.device("cpu"))
    a = _Req("a")
    _step(rows, [_Chunk(a, 6, [1, 2])])
    # preempted and scheduled again: a new list, whose first block may even be the same
    placed, written = _step(rows, [_Chunk(a, 6, [1, 4])])
    assert written == 2 and rows.table[placed[0], :2].tolist() == [1, 4]
    rows.check_integrity()


def test_rows_are_released_and_reused_and_absent_requests_make_room():
    rows = TableRows(3, 4, torch.device("cpu"))
    reqs = [_Req(str(i)) for i in range(5)]
    _step(rows, [_Chunk(reqs[0], 0, [1]), _Chunk(reqs[1], 0, [2])])
    rows.release("0")
    rows.release("never-placed")  # no-op
    _step(rows, [_Chunk(reqs[1], 1, [2]), _Chunk(reqs[2], 0, [3]), _Chunk(reqs[3], 0, [4])])
    # a full table: a batch of requests not all placed evicts those not in it
    placed, _ = _step(rows, [_Chunk(reqs[4], 0, [5]), _Chunk(reqs[3], 1, [4])])
    assert len(set(placed)) == 2 and set(rows._rows) == {"3", "4"}
    rows.check_integrity()
