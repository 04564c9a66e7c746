"""The pool's checksum (XXH3-64, format.py) of KV blocks, computed on the GPU.

A block read from its file into a pinned page, without the CPU hashing it, is verified
once its copy is on the GPU (paged_io.py), in two passes: the first sums each 1 KiB
block's stripes per lane, all blocks of all rows side by side (programs of 16 KiB); the
second, one program per row, carries the accumulators through those sums and the
scrambles between them in order (only 64 bytes a KiB, read 16 sums at a time), then the
partial block, the last stripe and the merge. (One program walking a whole 8 MiB row was
latency-bound: 2.6 ms against 1.0 ms now, on an H100.) The value is XXH3-64 with the
default secret and seed 0, bit for bit what the `xxhash` module gives for the same bytes
(tests compare them), for payloads longer than 240 bytes whose length is a multiple of 8
(every KV block; `supports` says).

XXH3 for such inputs: 8 lanes of 64-bit accumulators; each 64-byte stripe adds, per lane,
the neighbour lane's word and the 32x32-bit product of the word XOR a secret word; every
16 stripes the accumulators are scrambled; the last stripe of the input is added once more
with its own secret words; the lanes are then folded pairwise (a 64x64->128-bit product,
high XOR low) into one value and avalanched.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: reads are verified on the CPU, as they read
    triton = None

# XXH3's default secret ("kSecret"), 192 bytes
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_INIT_ACC = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)
_STRIPE, _BLOCK = 64, 1024  # bytes: a stripe, and 16 stripes between scrambles
SEGMENT = 16  # 1 KiB blocks a program of the first pass sums (16 KiB of a row)
CHAIN_TILE = 16  # block sums the second pass loads at once


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def supports(nbytes: int) -> bool:
    return nbytes > 240 and nbytes % 8 == 0


def _word(offset: int) -> int:
    return int.from_bytes(SECRET[offset:offset + 8], "little")


def signed(x: int) -> int:
    """A 64-bit checksum as the int64 with the same bits (how tensors hold them)."""
    return x - (1 << 64) if x >= 1 << 63 else x


@functools.lru_cache(maxsize=8)
def _constants(nbytes: int, device: torch.device) -> torch.Tensor:
    """The kernel's 64-bit constants for a payload length (int64 bit patterns):
    [0:24) the secret as aligned words (stripe s, lane l reads word s + l),
    [24:32) the last stripe's secret words (byte 121 on), [32:40) the merge's (byte 11 on),
    [40:48) the initial accumulators, [48] the merge's start (length x PRIME64_1)."""
    words = [_word(8 * i) for i in range(24)]
    words += [_word(192 - _STRIPE - 7 + 8 * i) for i in range(8)]
    words += [_word(11 + 8 * i) for i in range(8)]
    words += list(_INIT_ACC)
    words.append(nbytes * _P64_1 % (1 << 64))
    return torch.tensor([signed(w) for w in words], dtype=torch.int64, device=device)


if triton is not None:
    @triton.jit
    def _mul128_fold64(a, b):
        lo_lo = (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF)
        hi_lo = (a >> 32) * (b & 0xFFFFFFFF)
        lo_hi = (a & 0xFFFFFFFF) * (b >> 32)
        hi_hi = (a >> 32) * (b >> 32)
        cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi
        upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
        lower = (cross << 32) | (lo_lo & 0xFFFFFFFF)
        return lower ^ upper

    @triton.jit
    def _lane(x, lanes, i: tl.constexpr):
        return tl.sum(tl.where(lanes == i, x, 0), axis=0)

    @triton.jit
    def _block_sums_kernel(rows_ptr, ids_ptr, row_words, num_blocks, consts_ptr, sums_ptr,
                           G: tl.constexpr):
        """Program (r, g): the per-lane sums of 1 KiB blocks [g G, g G + G) of row r."""
        r = tl.program_id(0)
        g = tl.program_id(1)
        base = rows_ptr + tl.load(ids_ptr + r) * row_words
        j = tl.arange(0, G * 16)[:, None]  # the segment's stripes, 16 a block
        lanes = tl.arange(0, 8)[None, :]
        block = g * G + j // 16
        word = block * 128 + (j % 16) * 8
        m = block < num_blocks
        d = tl.load(base + word + lanes, mask=m, other=0).to(tl.uint64, bitcast=True)
        n = tl.load(base + word + (lanes ^ 1), mask=m, other=0).to(tl.uint64, bitcast=True)
        dk = d ^ tl.load(consts_ptr + j % 16 + lanes).to(tl.uint64, bitcast=True)
        sums = tl.sum(tl.reshape(n + (dk & 0xFFFFFFFF) * (dk >> 32), (G, 16, 8)), axis=1)
        b = g * G + tl.arange(0, G)[:, None]
        tl.store(sums_ptr + (r * num_blocks + b) * 8 + lanes, sums.to(tl.int64, bitcast=True),
                 mask=b < num_blocks)

    @triton.jit
    def _chain_kernel(rows_ptr, ids_ptr, row_words, num_words, num_blocks, tail_stripes,
                      consts_ptr, sums_ptr, expected_ptr, hashes_ptr, ok_ptr, T: tl.constexpr):
        """Program r: the accumulators through every block's sum and scramble, in order
        (T block sums loaded at once), then the partial block, the last stripe, the merge."""
        r = tl.program_id(0)
        base = rows_ptr + tl.load(ids_ptr + r) * row_words
        s = tl.arange(0, 16)[:, None]
        lanes = tl.arange(0, 8)
        here = s * 8 + lanes[None, :]
        neighbour = s * 8 + (lanes ^ 1)[None, :]
        key = tl.load(consts_ptr + s + lanes[None, :]).to(tl.uint64, bitcast=True)
        scramble = tl.load(consts_ptr + 16 + lanes).to(tl.uint64, bitcast=True)
        acc = tl.load(consts_ptr + 40 + lanes).to(tl.uint64, bitcast=True)
        t_of = tl.arange(0, T)[:, None]
        b = 0
        while b < num_blocks:  # (a while loop: Triton's interpreter takes no such range)
            tile = tl.load(sums_ptr + (r * num_blocks + b + t_of) * 8 + lanes[None, :],
                           mask=b + t_of < num_blocks, other=0).to(tl.uint64, bitcast=True)
            for t in tl.static_range(T):
                nxt = acc + tl.sum(tl.where(t_of == t, tile, 0), axis=0)
                nxt = ((nxt ^ (nxt >> 47)) ^ scramble) * 0x9E3779B1
                acc = tl.where(b + t < num_blocks, nxt, acc)
            b += T
        p = base + num_blocks * 128  # the last, partial block: no scramble after it
        m = s < tail_stripes
        d = tl.load(p + here, mask=m, other=0).to(tl.uint64, bitcast=True)
        n = tl.load(p + neighbour, mask=m, other=0).to(tl.uint64, bitcast=True)
        dk = d ^ key
        acc += tl.sum(tl.where(m, n + (dk & 0xFFFFFFFF) * (dk >> 32), 0), axis=0)
        p = base + num_words - 8  # the input's last stripe, with its own secret words
        d = tl.load(p + lanes).to(tl.uint64, bitcast=True)
        n = tl.load(p + (lanes ^ 1)).to(tl.uint64, bitcast=True)
        dk = d ^ tl.load(consts_ptr + 24 + lanes).to(tl.uint64, bitcast=True)
        acc += n + (dk & 0xFFFFFFFF) * (dk >> 32)
        x = acc ^ tl.load(consts_ptr + 32 + lanes).to(tl.uint64, bitcast=True)
        h = tl.load(consts_ptr + 48).to(tl.uint64, bitcast=True)
        h += _mul128_fold64(_lane(x, lanes, 0), _lane(x, lanes, 1))
        h += _mul128_fold64(_lane(x, lanes, 2), _lane(x, lanes, 3))
        h += _mul128_fold64(_lane(x, lanes, 4), _lane(x, lanes, 5))
        h += _mul128_fold64(_lane(x, lanes, 6), _lane(x, lanes, 7))
        h ^= h >> 37
        h *= 0x165667919E3779F9
        h ^= h >> 32
        tl.store(hashes_ptr + r, h.to(tl.int64, bitcast=True))
        expected = tl.load(expected_ptr + r).to(tl.uint64, bitcast=True)
        tl.store(ok_ptr + r, (h == expected).to(tl.int8))


def verify_rows(rows: torch.Tensor, ids: torch.Tensor, expected: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """XXH3-64 of rows[ids[i]] for each i, and whether each equals expected[i] (the
    checksum from the block's header, as an int64 bit pattern). rows: [N, nbytes / 8] int64
    (blocks as rows of words), contiguous; ids, expected: int64 on the same device. Queued
    on the current stream; returns (hashes int64, ok int8)."""
    assert rows.dtype == torch.int64 and rows.is_contiguous() and rows.dim() == 2
    nbytes = rows.shape[1] * 8
    assert supports(nbytes), nbytes
    hashes = torch.empty(len(ids), dtype=torch.int64, device=rows.device)
    ok = torch.empty(len(ids), dtype=torch.int8, device=rows.device)
    if len(ids):
        num_blocks = (nbytes - 1) // _BLOCK
        tail = ((nbytes - 1) - _BLOCK * num_blocks) // _STRIPE
        consts = _constants(nbytes, rows.device)
        sums = torch.empty((len(ids), max(num_blocks, 1), 8), dtype=torch.int64,
                           device=rows.device)
        if num_blocks:
            _block_sums_kernel[(len(ids), triton.cdiv(num_blocks, SEGMENT))](
                rows, ids, rows.shape[1], num_blocks, consts, sums, G=SEGMENT)
        _chain_kernel[(len(ids),)](rows, ids, rows.shape[1], rows.shape[1], num_blocks, tail,
                                   consts, sums, expected, hashes, ok, T=CHAIN_TILE,
                                   num_warps=1)
    return hashes, ok
