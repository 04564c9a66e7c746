"""Staged rows placed into KV blocks on the GPU (shoal/connectors/store/gpu_place.py): each
row that passed its check, or had none, lands in its target; a failed one leaves its block
as it was. On CPU through Triton's interpreter (tests/conftest.py); compiled on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from shoal.connectors.store import gpu_place, gpu_xxh3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("row_words", [32, 4096, 4096 + 40, 3 * 4096])
def test_rows_that_passed_or_had_no_check_land_and_failed_ones_leave_their_block(row_words):
    """Row lengths below, at and past a program's tile; targets in any order."""
    rng = random.Random(row_words)
    kv = torch.randint(-2**62, 2**62, (20, row_words), dtype=torch.int64, device=DEVICE)
    before = kv.clone()
    staging = torch.randint(-2**62, 2**62, (9, row_words), dtype=torch.int64, device=DEVICE)
    targets = rng.sample(range(20), 9)
    checks = [(p, rng.getrandbits(64)) for p in sorted(rng.sample(range(9), 5))]
    passed = [True, False, True, True, False]
    values, spans = gpu_place.pack(targets, checks)
    ids = torch.tensor(values, dtype=torch.int64, device=DEVICE)
    assert all(at % 2 == 0 for at, _ in spans)  # every part 16-byte aligned
    got_targets, places, sums, of_row = (ids[at:at + k] for at, k in spans)
    assert got_targets.tolist() == targets and places.tolist() == [p for p, _ in checks]
    assert sums.tolist() == [gpu_xxh3.signed(c) for _, c in checks]
    ok = torch.tensor(passed, dtype=torch.int8, device=DEVICE)
    gpu_place.place_rows(kv, staging, got_targets, of_row, ok)
    failed = {p for (p, _), good in zip(checks, passed) if not good}
    want = before.clone()
    for r, target in enumerate(targets):
        if r not in failed:
            want[target] = staging[r]
    assert torch.equal(kv.cpu(), want.cpu())


def test_packing_without_checks_has_only_the_targets():
    values, spans = gpu_place.pack([5, 2, 7], [])
    assert values[:3] == [5, 2, 7] and spans == [(0, 3), (4, 0), (4, 0), (4, 0)]
