"""StepRows: one step's host arrays, built for the whole batch at once, are those of each
chunk built alone; a CUDA graph's inputs are the same arrays, padded."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shoal.engine.cuda_graphs import _Graph
from shoal.engine.scheduler import ScheduledChunk
from shoal.engine.step_inputs import StepInputs, StepRows
from shoal.engine.table_rows import TableRows

BS = 4
WIDTH = 16  # table columns: contexts up to 64 tokens
SCRATCH = 99


@dataclass
class _Req:
    request_id: str


def _chunk(rid: str, start: int, num_tokens: int, placeholders: int, sampling: bool,
           rng: random.Random) -> ScheduledChunk:
    """A chunk whose request's block list runs past it (a list only grows while held: the
    overlap loop schedules the next step before this one ran)."""
    blocks = rng.sample(range(1, 90), (start + num_tokens + BS - 1) // BS + rng.randrange(3))
    ids = [rng.randrange(512) for _ in range(num_tokens - placeholders)]
    return ScheduledChunk(_Req(rid), start, num_tokens, ids, placeholders, blocks, sampling, 0)


def _random_batch(rng: random.Random, size: int, kinds: tuple[str, ...]) -> list[ScheduledChunk]:
    """Decodes (a known token or the previous step's placeholder), prefill chunks from any
    position (sampling at the prompt's end or not; "one": cut to one token by the step's
    budget, not sampling), in a random order."""
    chunks = []
    for i in range(size):
        kind = rng.choice(kinds)
        start = rng.randrange(40)
        if kind in ("decode", "placeholder", "one"):
            chunks.append(_chunk(f"r{i}", start, 1, int(kind == "placeholder"), kind != "one",
                                 rng))
        else:
            n = rng.randrange(1, 24)
            ends = kind == "prefill_end"
            chunks.append(_chunk(f"r{i}", start, n, int(ends and rng.random() < 0.5), ends, rng))
    return chunks


def _each_chunk_alone(chunks, prev_rows) -> dict[str, list[int]]:
    """The arrays, written out row by row."""
    out = {k: [] for k in ("ids", "positions", "slot_blocks", "slot_offsets", "starts", "lens",
                           "ctxs", "sample_rows", "fill_rows", "sources")}
    row = 0
    for c in chunks:
        out["starts"].append(row)
        out["lens"].append(c.num_tokens)
        out["ctxs"].append(c.start + c.num_tokens)
        for j in range(c.num_tokens):
            p = c.start + j
            out["ids"].append(c.token_ids[j] if j < len(c.token_ids) else 0)
            out["positions"].append(p)
            out["slot_blocks"].append(c.block_ids[p // BS])
            out["slot_offsets"].append(p % BS)
        row += c.num_tokens
        if c.is_sampling:
            out["sample_rows"].append(row - 1)
        if c.num_placeholders:
            out["fill_rows"].append(row - 1)
            out["sources"].append(prev_rows[c.request.request_id])
    return out


ANY = ("decode", "placeholder", "one", "prefill", "prefill_end")
ONE_TOKEN = ("decode", "placeholder", "one")  # a row per chunk (the builder's short path)


@pytest.mark.parametrize("kinds", [ANY, ONE_TOKEN], ids=["any", "one_token"])
@pytest.mark.parametrize("seed", range(6))
def test_a_batch_s_rows_are_each_chunk_s_rows(seed, kinds):
    rng = random.Random(seed)
    chunks = _random_batch(rng, rng.randrange(1, 20), kinds)
    prev_rows = {c.request.request_id: rng.randrange(64) for c in chunks}
    table = TableRows(2 * len(chunks), WIDTH, torch.device("cpu"))
    rows = StepRows.of(chunks, BS, prev_rows, table)
    for name, expected in _each_chunk_alone(chunks, prev_rows).items():
        got = getattr(rows, name)
        assert got.dtype == np.int32, name
        assert got.tolist() == expected, name
    # the table entries written give each chunk's row its blocks up to its last position
    table.write(torch.from_numpy(rows.table_indices), torch.from_numpy(rows.table_values))
    for row, c in zip(rows.table_rows.tolist(), chunks):
        need = (c.start + c.num_tokens - 1) // BS + 1
        assert table.table[row, :need].tolist() == c.block_ids[:need]


def test_an_empty_batch_has_empty_rows():
    """An idle ADP owner's padding step: no rows, and the copy still works."""
    rows = StepRows.of([], BS, {}, TableRows(2, WIDTH, torch.device("cpu")))
    assert all(getattr(rows, f).size == 0 for f in rows.__slots__)
    sent = StepInputs(torch.device("cpu")).send([rows.ids, rows.starts])
    assert [t.numel() for t in sent] == [0, 0]


def _graph_inputs(g: _Graph, rows: StepRows, table: TableRows) -> dict[str, list[int]]:
    """The graph's inputs after a fill through a host buffer that held other values (the
    graphs share one: what a padded row does not write would be stale)."""
    host = torch.full((g.host_size(WIDTH),), 77, dtype=torch.int32)
    staging = torch.zeros_like(host)
    g.fill(rows, host, table, staging)
    names = ("ids", "positions", "slot_blocks", "slot_offsets", "starts", "lens", "ctxs",
             "table_rows", "samples", "fill_rows", "sources")
    return dict(zip(names, (v.tolist() for v in g._vectors(g.buffer))))


def test_a_decode_graph_reads_the_eager_rows_padded():
    rng = random.Random(7)
    chunks = [_chunk(f"r{i}", rng.randrange(40), 1, i % 2, True, rng) for i in range(5)]
    prev_rows = {c.request.request_id: i for i, c in enumerate(reversed(chunks))}
    table = TableRows(16, WIDTH, torch.device("cpu"))
    rows = StepRows.of(chunks, BS, prev_rows, table)
    g = _Graph(8, True, WIDTH, torch.device("cpu"), SCRATCH)
    got = _graph_inputs(g, rows, table)
    pad = [0] * 3
    assert got["ids"] == rows.ids.tolist() + pad
    assert got["positions"] == rows.positions.tolist() + pad
    assert got["slot_blocks"] == rows.slot_blocks.tolist() + [SCRATCH] * 3  # no request's
    assert got["slot_offsets"] == rows.slot_offsets.tolist() + pad
    assert got["starts"] == got["samples"] == list(range(8))
    assert got["lens"] == [1] * 8
    assert got["ctxs"] == rows.ctxs.tolist() + pad  # padded rows attend to nothing
    assert got["table_rows"] == rows.table_rows.tolist() + pad
    k = rows.fill_rows.size
    assert (got["fill_rows"][:k], got["sources"][:k]) == (rows.fill_rows.tolist(),
                                                          rows.sources.tolist())
    for row, c in zip(rows.table_rows.tolist(), chunks):  # the entries went to the kept table
        assert table.table[row, :c.start // BS + 1].tolist() == c.block_ids[:c.start // BS + 1]


def test_a_prefill_graph_reads_the_eager_rows_then_an_empty_request():
    rng = random.Random(8)
    chunk = _chunk("a", 17, 11, 1, True, rng)
    table = TableRows(4, WIDTH, torch.device("cpu"))
    rows = StepRows.of([chunk], BS, {"a": 3}, table)
    g = _Graph(16, False, WIDTH, torch.device("cpu"), SCRATCH, parts=1)
    got = _graph_inputs(g, rows, table)
    assert got["ids"] == rows.ids.tolist() + [0] * 5
    assert got["positions"] == list(range(17, 28)) + [0] * 5
    assert got["slot_blocks"] == rows.slot_blocks.tolist() + [SCRATCH] * 5
    assert (got["starts"], got["lens"], got["ctxs"]) == ([0, 11], [11, 5], [28, 0])
    assert got["samples"] == [10, 10]
    assert (got["fill_rows"][:1], got["sources"][:1]) == ([10], [3])
