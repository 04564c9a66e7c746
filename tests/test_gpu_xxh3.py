"""The GPU's check of pool blocks (shoal/connectors/store/gpu_xxh3.py) is xxhash's XXH3-64.
On CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a
GPU); compiled on a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

from shoal.connectors.store import gpu_xxh3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("nbytes", [248, 256, 1024, 1032, 4160, 12344, 1 << 18])
def test_rows_hash_to_xxhash_values_in_any_order(nbytes):
    """Every length class of XXH3's long path: one stripe past 240 bytes, whole and partial
    1 KiB blocks, a last stripe overlapping the previous one. A wrong expected value is
    flagged; the others pass."""
    rows = np.frombuffer(os.urandom(5 * nbytes), dtype=np.int64).reshape(5, nbytes // 8)
    want = [xxhash.xxh3_64_intdigest(rows[i].tobytes()) for i in range(5)]
    ids = [3, 0, 4, 1]
    expected = [gpu_xxh3.signed(want[i]) for i in ids]
    expected[2] ^= 1 << 40
    hashes, ok = gpu_xxh3.verify_rows(torch.from_numpy(rows.copy()).to(DEVICE),
                                      torch.tensor(ids, device=DEVICE),
                                      torch.tensor(expected, device=DEVICE))
    assert [h % (1 << 64) for h in hashes.tolist()] == [want[i] for i in ids]
    assert ok.tolist() == [1, 1, 0, 1]


def test_one_flipped_bit_anywhere_is_caught():
    """A bit flipped in the first word, in a scrambled block's middle, in the last stripe
    (hashed twice when the length is a multiple of 64) changes the hash."""
    nbytes = 4096
    row = np.frombuffer(os.urandom(nbytes), dtype=np.int64).reshape(1, -1).copy()
    good = gpu_xxh3.signed(xxhash.xxh3_64_intdigest(row.tobytes()))
    flipped = np.repeat(row, 4, axis=0)
    for r, (word, bit) in enumerate([(0, 0), (200, 33), (nbytes // 8 - 1, 63), (505, 7)]):
        flipped[r, word] ^= np.int64(1) << np.int64(bit)
    _, ok = gpu_xxh3.verify_rows(torch.from_numpy(flipped).to(DEVICE),
                                 torch.arange(4, device=DEVICE),
                                 torch.full((4,), good, dtype=torch.int64, device=DEVICE))
    assert ok.tolist() == [0, 0, 0, 0]


def test_the_lengths_it_takes():
    assert gpu_xxh3.supports(248) and gpu_xxh3.supports(1 << 20)
    assert not gpu_xxh3.supports(240) and not gpu_xxh3.supports(1028)
    assert gpu_xxh3.signed((1 << 64) - 1) == -1 and gpu_xxh3.signed(5) == 5
