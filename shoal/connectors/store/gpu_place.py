"""Staged rows placed into their KV blocks on the GPU, those that failed their check left
out, in one kernel (paged_io.py's loads from files).

A chunk read from files is staged on the GPU as rows of 8-byte words, its rows read from
files are verified there (gpu_xxh3.py), and each row that passed (or needed no check: a
tier hit) is copied into its KV block; a row that failed leaves its block as it was. One
launch does what took six torch calls (a mask, two index copies, a gather, a select),
each of which let go of the GIL and took it back: with several I/O threads a chunk's
launch queued behind the others' for every call (docs/benchmarks.md, twenty-second
session).
"""

from __future__ import annotations

import torch

from shoal.connectors.store import gpu_xxh3

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: paged_io places rows with torch
    triton = None

TILE = 4096  # words a program copies (32 KiB)

if triton is not None:
    @triton.jit
    def _place_kernel(kv_ptr, staging_ptr, targets_ptr, check_ptr, ok_ptr, row_words,
                      TILE: tl.constexpr):
        """Program (r, t): words [t TILE, t TILE + TILE) of staged row r into KV block
        targets[r], unless the row was checked (check[r] >= 0) and failed."""
        r = tl.program_id(0)
        t = tl.program_id(1)
        check = tl.load(check_ptr + r)
        passed = tl.load(ok_ptr + tl.maximum(check, 0)) != 0
        if (check < 0) | passed:
            words = t * TILE + tl.arange(0, TILE)
            m = words < row_words
            data = tl.load(staging_ptr + r.to(tl.int64) * row_words + words, mask=m)
            target = tl.load(targets_ptr + r)
            tl.store(kv_ptr + target * row_words + words, data, mask=m)


def pack(targets: list[int], checks: list[tuple[int, int]]
         ) -> tuple[list[int], list[tuple[int, int]]]:
    """A chunk's small inputs as one list of int64 values, and where each part lies in it
    (start, length): the staged rows' targets, the rows to check (their places among the
    staged rows), their checksums (gpu_xxh3.signed), and each row's place among the checks
    (-1: none; empty without checks). Each part starts at an even place, 16-byte aligned
    (Triton compiles a kernel per pointer alignment; paged_io's warm_up compiles the
    aligned one)."""
    of_row = [-1] * len(targets) if checks else []
    for j, (place, _) in enumerate(checks):
        of_row[place] = j
    values: list[int] = []
    spans = []
    for part in (targets, [p for p, _ in checks], [gpu_xxh3.signed(c) for _, c in checks],
                 of_row):
        values += [0] * (len(values) % 2)
        spans.append((len(values), len(part)))
        values += part
    return values, spans


def place_rows(kv_rows: torch.Tensor, staging: torch.Tensor, targets: torch.Tensor,
               check: torch.Tensor, ok: torch.Tensor) -> None:
    """kv_rows[targets[r]] = staging[r] for each r < len(targets), except where
    check[r] >= 0 and ok[check[r]] == 0 (that block keeps its bytes). kv_rows, staging:
    [*, words] int64, contiguous, rows of the same length; targets, check: int64; ok: int8
    (at least one element); all on one GPU. Queued on the current stream."""
    assert triton is not None, "place_rows needs Triton (paged_io uses it only where it verifies)"
    assert kv_rows.dtype == staging.dtype == torch.int64
    assert kv_rows.is_contiguous() and staging.is_contiguous()
    assert kv_rows.shape[1] == staging.shape[1] and len(check) == len(targets) and len(ok)
    n, row_words = len(targets), kv_rows.shape[1]
    if n:
        _place_kernel[(n, triton.cdiv(row_words, TILE))](
            kv_rows, staging, targets, check, ok, row_words, TILE=TILE)
