"""The absorbed MLA decode in Triton: reads the latent cache through the block table.

After absorption (shoal/model/mla.py) a decode row is H query heads over ONE shared head
whose key is a cache entry [latent L | rotary key R] and whose value is its latent part:

    score(h, j) = (q_latent[h] . latent[j] + q_rot[h] . k_rot[j]) * scale
    out[h]      = sum_j softmax_j(score(h, .)) latent[j]                   [L]

grid (requests, head tiles, splits): a program takes HT heads of one request, so each
latent tile is read once for all of them (all heads at once for V2-Lite's 16; eight reads
for V3's 128), over one of `splits` equal slices of the context. The running (max, sum,
accumulator) softmax is kept in float32, as in shoal/model/paged_attention.py, whose decode
kernel this follows. With one split the program writes the output; with more (a batch too
small to give every SM two programs: the slices' tiles then load in parallel, not one
after another), each writes its slice's (max, sum, accumulator) and a second launch folds
them (flash-decoding). `MLAttention.absorbed` (gathers + SDPA) is its reference in tests
(on CPU through Triton's interpreter).
"""

from __future__ import annotations

import functools

import torch

from shoal.model.paged_attention import HAS_TRITON, _next_pow2, _precision

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride_table"])
    def _mla_decode_kernel(q_ptr, c_ptr, o_ptr, part_ptr, stats_ptr, table_ptr, lens_ptr,
                           stride_qb, stride_qh, stride_cb, stride_ct, stride_ob, stride_oh,
                           stride_table, scale, H: tl.constexpr, HT: tl.constexpr,
                           L: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                           PRECISION: tl.constexpr):
        b = tl.program_id(0)
        heads = tl.program_id(1) * HT + tl.arange(0, HT)
        split = tl.program_id(2)
        ctx = tl.load(lens_ptr + b)
        per = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE  # this split's slice of the context
        end = tl.minimum((split + 1) * per, ctx)
        lat = tl.arange(0, L)
        rot = tl.arange(0, RP)
        h_mask = heads < H
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + lat[None, :], mask=h_mask[:, None], other=0.0)  # [HT, L]
        q_rot = tl.load(q_row + L + rot[None, :], mask=h_mask[:, None] & (rot[None, :] < R),
                        other=0.0)  # [HT, RP]
        m = tl.full([HT], float("-inf"), tl.float32)
        total = tl.zeros([HT], tl.float32)
        acc = tl.zeros([HT, L], tl.float32)
        t = tl.arange(0, TILE)
        for start in tl.range(split * per, end, TILE):  # (pipelined: loads run ahead)
            pos = start + t
            valid = pos < end
            # int64: a block's offset (block id x all layers' bytes of a block) passes 2**31
            block = tl.load(table_ptr + b * stride_table + pos // BLOCK_SIZE, mask=valid,
                            other=0).to(tl.int64)
            entry = c_ptr + block[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_ct
            latent = tl.load(entry + lat[None, :], mask=valid[:, None], other=0.0)  # [TILE, L]
            k_rot = tl.load(entry + L + rot[None, :], mask=valid[:, None] & (rot[None, :] < R),
                            other=0.0)  # [TILE, RP]
            s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION).to(tl.float32)
            s += tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION).to(tl.float32)
            s = tl.where(valid[None, :], s * scale, float("-inf"))  # [HT, TILE]
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent,
                                                input_precision=PRECISION).to(tl.float32)
            m = m_new
        if SPLITS == 1:
            out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding row (ctx 0): 0
            tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + lat[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])
        else:  # [B, SPLITS, H, L] accumulators, [B, SPLITS, 2, H] (max, sum); an empty
            row = b * SPLITS + split  # slice leaves (-inf, 0, 0)
            tl.store(part_ptr + (row * H + heads[:, None]) * L + lat[None, :], acc,
                     mask=h_mask[:, None])
            tl.store(stats_ptr + row * 2 * H + heads, m, mask=h_mask)
            tl.store(stats_ptr + row * 2 * H + H + heads, total, mask=h_mask)

    @triton.jit
    def _mla_combine_kernel(part_ptr, stats_ptr, o_ptr, stride_ob, stride_oh, H: tl.constexpr,
                            HT: tl.constexpr, L: tl.constexpr, SPLITS: tl.constexpr):
        """Fold the splits' softmax states: each scaled to the largest max."""
        b = tl.program_id(0)
        heads = tl.program_id(1) * HT + tl.arange(0, HT)
        h_mask = heads < H
        lat = tl.arange(0, L)
        m = tl.full([HT], float("-inf"), tl.float32)
        for s in range(SPLITS):
            m = tl.maximum(m, tl.load(stats_ptr + (b * SPLITS + s) * 2 * H + heads, mask=h_mask,
                                      other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: a padding row
        total = tl.zeros([HT], tl.float32)
        acc = tl.zeros([HT, L], tl.float32)
        for s in range(SPLITS):
            row = b * SPLITS + s
            w = tl.exp(tl.load(stats_ptr + row * 2 * H + heads, mask=h_mask,
                               other=float("-inf")) - m)
            total += w * tl.load(stats_ptr + row * 2 * H + H + heads, mask=h_mask, other=0.0)
            acc += w[:, None] * tl.load(part_ptr + (row * H + heads[:, None]) * L + lat[None, :],
                                        mask=h_mask[:, None], other=0.0)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + lat[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None])


MAX_SPLITS = 8
HEAD_TILE = 16  # heads a program takes (a tl.dot needs at least 16 rows)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The device's SMs (a CPU's interpreter counts as 4)."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 4


def num_splits(batch: int, head_tiles: int, device: torch.device) -> int:
    """Context slices per request: about enough programs for two on every SM, a power of
    two (few kernel variants), at most MAX_SPLITS. Fixed for a batch size (graph-safe)."""
    sms = _num_sms(device)
    want = max(1, min(MAX_SPLITS, 2 * sms // max(batch * head_tiles, 1)))
    return 1 << (want.bit_length() - 1)


def warm_up(q_like: torch.Tensor, cache: torch.Tensor, latent_dim: int, scale: float,
            scratch_block: int) -> None:
    """Compile the latent decode at every split count now (start-up): `num_splits` picks
    one per batch size, so an engine without decode graphs would meet each in the first
    step of that size. `q_like` [1, H, L + R]: the queries' heads, width and dtype."""
    q = torch.zeros_like(q_like)
    table = torch.full((1, 1), scratch_block, dtype=torch.int32, device=cache.device)
    lens = torch.ones(1, dtype=torch.int32, device=cache.device)
    splits = 1
    while splits <= MAX_SPLITS:
        mla_decode(q, cache, table, lens, latent_dim, scale, splits=splits)
        splits *= 2


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               context_lens: torch.Tensor, latent_dim: int, scale: float,
               out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """q [B, H, L + R] (the absorbed query: latent part, then rotary); cache [num_blocks,
    block_size, 1, L + R]; block_table [B, max_blocks]; context_lens [B] (0: a padding row,
    output 0) -> out [B, H, L]. Reads every tensor in place (CUDA-graph safe). L must be a
    power of two (512 in every DeepSeek). `splits`: context slices (`num_splits` if None)."""
    batch, num_heads, width = q.shape
    _, block_size, _, _ = cache.shape
    assert latent_dim == _next_pow2(latent_dim), f"latent width {latent_dim} is not a power of 2"
    out = q.new_empty(batch, num_heads, latent_dim) if out is None else out
    head_tiles = triton.cdiv(num_heads, HEAD_TILE)
    splits = splits or num_splits(batch, head_tiles, q.device)
    part = stats = out  # one split writes `out` itself (the kernel never touches these)
    if splits > 1:  # the splits' states (float32): written, then folded
        part = q.new_empty(batch * splits * num_heads * latent_dim, dtype=torch.float32)
        stats = q.new_empty(batch * splits * 2 * num_heads, dtype=torch.float32)
    _mla_decode_kernel[(batch, head_tiles, splits)](
        q, cache, out, part, stats, block_table, context_lens, q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        scale, H=num_heads, HT=HEAD_TILE, L=latent_dim, R=width - latent_dim,
        RP=max(16, _next_pow2(width - latent_dim)), BLOCK_SIZE=block_size,
        TILE=max(block_size, 16), SPLITS=splits, PRECISION=_precision(q))
    if splits > 1:
        _mla_combine_kernel[(batch, head_tiles)](
            part, stats, out, out.stride(0), out.stride(1), H=num_heads, HT=HEAD_TILE,
            L=latent_dim, SPLITS=splits)
    return out
