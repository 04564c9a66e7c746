"""A decode attention kernel that loads its next tile of keys while it folds this one (an
experiment beside shoal.model.paged_attention's `_decode_kernel`, for
scripts/prefill_attn_probe.py).

The shipped kernel's key loop is pipelined by Triton (`tl.range`), but with two stages its
compiled loop waits for tile i, folds it, then loads tile i+1's block ids (a plain load the
warp waits for) and starts tile i+1's copies: a program never has a load in flight while it
computes. Here the loop is pipelined by hand in registers: tile i+1's K and V are loaded
(their block ids read one iteration earlier) before tile i is folded, so the fold runs
while they arrive. Launched with one stage (Triton's pipeliner off).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 scripts/decode_prefetch.py   # checks it
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.model import paged_attention as pa


@triton.jit
def _fold(q, k, v, m, total, acc, scale, PRECISION: tl.constexpr):
    """One whole tile's keys k and values v [tile, D] into the online softmax (base 2)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, total, acc


@triton.jit(do_not_specialize=["stride_table"])
def _decode_prefetch_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, lens_ptr,
                            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                            stride_vb, stride_vt, stride_vh, stride_ob, stride_oh, stride_table,
                            scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                            PRECISION: tl.constexpr):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    heads = kvh * G + g
    q_mask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    t = tl.arange(0, TILE)
    slot = (t % BLOCK_SIZE)[:, None]
    k_head = k_ptr + kvh * stride_kh + slot * stride_kt + d[None, :]
    v_head = v_ptr + kvh * stride_vh + slot * stride_vt + d[None, :]
    table_row = table_ptr + b * stride_table
    whole = ctx // TILE * TILE
    if whole > 0:
        blocks = tl.load(table_row + t // BLOCK_SIZE).to(tl.int64)[:, None]
        k = tl.load(k_head + blocks * stride_kb)
        v = tl.load(v_head + blocks * stride_vb)
        nxt = TILE + t  # the next tile's block ids, read a tile ahead of its keys
        blocks = tl.load(table_row + nxt // BLOCK_SIZE, mask=nxt < whole, other=0)
        blocks = blocks.to(tl.int64)[:, None]
        for start in range(TILE, whole, TILE):
            k_next = tl.load(k_head + blocks * stride_kb)
            v_next = tl.load(v_head + blocks * stride_vb)
            nxt = start + TILE + t
            blocks = tl.load(table_row + nxt // BLOCK_SIZE, mask=nxt < whole, other=0)
            blocks = blocks.to(tl.int64)[:, None]
            m, total, acc = _fold(q, k, v, m, total, acc, scale, PRECISION)
            k, v = k_next, v_next
        m, total, acc = _fold(q, k, v, m, total, acc, scale, PRECISION)
    if whole < ctx:
        pos = whole + t
        valid = pos < ctx
        m, total, acc = pa._attend_tile(
            q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, table_row, pos, valid,
            valid[None, :], d, stride_kb, stride_kt, stride_vb, stride_vt, scale, m, total, acc,
            D, DP, BLOCK_SIZE, PRECISION, True)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_prefetch(q, k_cache, v_cache, block_table, context_lens, tile: int = 64,
                          warps: int = 4):
    """As `paged_decode`, for head dims that are powers of two (D == DP) and tiles of whole
    blocks."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim == max(16, triton.next_power_of_2(head_dim))
    tile = max(tile, block_size)
    # a key's slot is its place in the tile modulo the block: tiles are whole blocks
    assert tile % block_size == 0, (tile, block_size)
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    _decode_prefetch_kernel[(num_kv_heads, batch)](
        q, k_cache, v_cache, out, block_table, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), head_dim ** -0.5 * pa.LOG2E, G=group,
        GP=max(16, triton.next_power_of_2(group)), D=head_dim, DP=head_dim,
        BLOCK_SIZE=block_size, TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=1)
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    for bs, tile, ctxs in ((16, 32, [0, 1, 31, 32, 33, 64, 95, 200]), (16, 16, [5, 16, 48, 70]),
                           (32, 64, [64, 65, 128, 191])):
        nb = -(-max(ctxs) // bs) + 1
        rows = len(ctxs)
        k = torch.randn(rows * nb + 1, bs, 2, 32)
        v = torch.randn(rows * nb + 1, bs, 2, 32)
        table = torch.randperm(rows * nb).view(rows, nb).to(torch.int32)
        q = torch.randn(rows, 6, 32)
        lens = torch.tensor(ctxs, dtype=torch.int32)
        want = pa.paged_decode(q, k, v, table, lens)
        got = paged_decode_prefetch(q, k, v, table, lens, tile=tile)
        print(bs, tile, ctxs, "max |diff|", (got - want).abs().max().item())
        assert torch.allclose(got, want, atol=1e-5)
