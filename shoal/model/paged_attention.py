"""Paged attention in Triton: kernels that read the block table instead of copying blocks.

The KV cache is block-major (`shoal.kv.kv_cache`): layer i's keys are a strided view
`k_cache[block, slot, kv_head, dim]`. Both kernels walk a request's blocks through its
row of the block table, keep a running (max, sum, accumulator) softmax in float32, and
never materialise the gathered context. GQA: query head h reads KV head h // G.

    decode   one query per request (its newest token), all of its context
             grid (requests, kv_heads): the G query heads of one KV head together, so each
             key/value tile is read once for all of them
    prefill  a chunk of n new tokens per request at positions [ctx - n, ctx), causal over
             [0, ctx): chunked prefill and prefix hits alike (the chunk's own K/V are in
             the cache already); grid (requests, query tiles, query heads x parts). A
             short chunk over a long context (a prompt's last tokens after a pool hit:
             32 programs for 64 tokens of Llama-8B) would leave most SMs idle and walk
             8k keys in series, so its context is cut into parts, each part's running
             softmax is kept, and a second kernel folds them (64 new tokens over 8192:
             0.42 -> 0.10 ms on an H100)

Both walk the keys in a `tl.range` loop that Triton pipelines (at 2 stages the next tile's
copies start after this one's fold, so they overlap other programs' work, not this one's:
scripts/decode_resources.py); tiles every query sees whole take no mask (in prefill those before
a query tile's first position, in decode all but the last), and the softmax runs in base
2 (logits scaled by log2(e), exp2). H100, bf16, 8 prompts x 4096 tokens from nothing: the
prefill kernel went from 204 to 272 TFLOP/s with Llama-1B's heads (SDPA's flash kernel on
contiguous tensors: 284) and from 179 to 303 with Llama-8B's (flash: 330); decode, 256
rows over 320 keys, 118 -> 96 us (1B) and 179 -> 159 us (8B)
(`scripts/prefill_attn_probe.py`).

The gather + SDPA path (`TorchBackend` in shoal.model.attention_backend) is the reference
these are tested against (tests/test_paged_attention.py; on CPU through Triton's interpreter).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without Triton: the reference path runs
    triton = None

HAS_TRITON = triton is not None


LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: logits scaled by log2(e)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _precision(q: torch.Tensor) -> str:
    """float32 models stay float32 in the dot products (tf32 would not match the reference)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


if HAS_TRITON:

    @triton.jit
    def _attend_tile(q, k_ptr, v_ptr, table_row_ptr, pos, valid, seen, d, stride_kb, stride_kt,
                     stride_vb, stride_vt, scale, m, total, acc, D: tl.constexpr,
                     DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                     MASKED: tl.constexpr):
        """One tile of keys at positions `pos` (`valid` ones exist; `seen` [rows, tile] says
        which query sees which; MASKED False: every key exists and every query sees it),
        their K/V read through the block table, folded into the running (max m, sum total,
        accumulator acc) of the online softmax. `scale` is the logits' times log2(e): the
        softmax runs in base 2 (exp2), m in those units."""
        # int64: a block's offset (block id x all layers' bytes of a block) passes 2**31
        if MASKED:
            block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
        else:
            block = tl.load(table_row_ptr + pos // BLOCK_SIZE)
        block = block.to(tl.int64)
        slot = pos % BLOCK_SIZE
        k_at = k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + d[None, :]
        v_at = v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + d[None, :]
        if MASKED:
            kv_mask = valid[:, None] & (d[None, :] < D)
            k = tl.load(k_at, mask=kv_mask, other=0.0)  # [tile, DP]
            v = tl.load(v_at, mask=kv_mask, other=0.0)
        elif D != DP:
            k = tl.load(k_at, mask=d[None, :] < D, other=0.0)
            v = tl.load(v_at, mask=d[None, :] < D, other=0.0)
        else:
            k = tl.load(k_at)
            v = tl.load(v_at)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        if MASKED:
            s = tl.where(seen, s, float("-inf"))  # [rows, tile]
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row that has seen no key yet (a later part of the context, past its position)
        # keeps max -inf: exp(-inf - -inf) would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision=PRECISION).to(tl.float32)
        return m_new, total, acc

    # the table's row stride is its width, which changes from step to step: not specialized
    # on (Triton would compile a variant for widths that are multiples of 16 in a request)
    @triton.jit(do_not_specialize=["stride_table"])
    def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, lens_ptr,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh,
                       stride_vb, stride_vt, stride_vh, stride_ob, stride_oh, stride_table,
                       scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                       PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        heads = kvh * G + g
        q_mask = (g[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=q_mask, other=0.0)  # [GP, DP]
        m = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        t = tl.arange(0, TILE)
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        table_row = table_ptr + b * stride_table
        whole = ctx // TILE * TILE  # whole tiles take no mask; the last part of one does
        for start in tl.range(0, whole, TILE):
            m, total, acc = _attend_tile(
                q, k_head, v_head, table_row, start + t, None, None, d, stride_kb, stride_kt,
                stride_vb, stride_vt, scale, m, total, acc, D, DP, BLOCK_SIZE, PRECISION, False)
        if whole < ctx:
            pos = whole + t
            valid = pos < ctx
            m, total, acc = _attend_tile(
                q, k_head, v_head, table_row, pos, valid, valid[None, :], d, stride_kb,
                stride_kt, stride_vb, stride_vt, scale, m, total, acc, D, DP, BLOCK_SIZE,
                PRECISION, True)
        # a padding row (ctx 0) attends to nothing: 0, not 0/0
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=q_mask)

    # the number of rows and of context parts change from step to step: not specialized on
    @triton.jit(do_not_specialize=["stride_table", "num_rows", "num_parts"])
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, stats_ptr, table_ptr, starts_ptr,
                        lens_ptr, ctx_ptr, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
                        num_rows, num_parts, scale, H: tl.constexpr, G: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        s_idx = tl.program_id(0)
        tile = tl.program_id(1)
        h = tl.program_id(2) // num_parts
        part = tl.program_id(2) % num_parts
        n = tl.load(lens_ptr + s_idx)
        if tile * BLOCK_M < n:
            ctx = tl.load(ctx_ptr + s_idx)
            row0 = tl.load(starts_ptr + s_idx)
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, DP)
            q_mask = (rows[:, None] < n) & (d[None, :] < D)
            q = tl.load(q_ptr + (row0 + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                        mask=q_mask, other=0.0)  # [BLOCK_M, DP]
            q_pos = ctx - n + rows  # each query's position; it sees keys at <= q_pos
            kvh = h // G
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DP], tl.float32)
            hi = tl.minimum(ctx, ctx - n + (tile + 1) * BLOCK_M)  # no later row sees more
            # this program's part of the keys: whole tiles, [start, end)
            per_part = tl.cdiv(tl.cdiv(hi, BLOCK_N), num_parts) * BLOCK_N
            start = part * per_part
            end = tl.minimum(hi, start + per_part)
            # the tiles every row of this one sees whole (keys up to its first row's
            # position) take no mask; the rest, along the diagonal, do
            unmasked = tl.maximum(start, tl.minimum(end, (ctx - n + tile * BLOCK_M + 1)
                                                    // BLOCK_N * BLOCK_N))
            kt = tl.arange(0, BLOCK_N)
            table_row = table_ptr + s_idx * stride_table
            k_head = k_ptr + kvh * stride_kh
            v_head = v_ptr + kvh * stride_vh
            for key0 in tl.range(start, unmasked, BLOCK_N):
                m, total, acc = _attend_tile(
                    q, k_head, v_head, table_row, key0 + kt, None, None, d, stride_kb,
                    stride_kt, stride_vb, stride_vt, scale, m, total, acc, D, DP, BLOCK_SIZE,
                    PRECISION, False)
            for key0 in tl.range(unmasked, end, BLOCK_N):
                pos = key0 + kt
                valid = pos < end
                seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal
                m, total, acc = _attend_tile(
                    q, k_head, v_head, table_row, pos, valid, seen, d, stride_kb, stride_kt,
                    stride_vb, stride_vt, scale, m, total, acc, D, DP, BLOCK_SIZE, PRECISION,
                    True)
            if num_parts == 1:
                out = acc / tl.where(total > 0, total, 1.0)[:, None]
                tl.store(o_ptr + (row0 + rows)[:, None] * stride_ot + h * stride_oh
                         + d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask)
            else:  # the part's running softmax, for _combine_kernel
                at = (part * num_rows + row0 + rows) * H + h
                row_mask = rows < n
                tl.store(part_ptr + at[:, None] * DP + d[None, :], acc, mask=row_mask[:, None])
                tl.store(stats_ptr + at * 2, m, mask=row_mask)
                tl.store(stats_ptr + at * 2 + 1, total, mask=row_mask)

    @triton.jit(do_not_specialize=["num_rows", "num_parts"])
    def _combine_kernel(o_ptr, part_ptr, stats_ptr, starts_ptr, lens_ptr, stride_ot, stride_oh,
                        num_rows, num_parts, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        BLOCK_M: tl.constexpr):
        """The rows of one (request, query tile, head): its parts' softmaxes folded into one."""
        s_idx = tl.program_id(0)
        tile = tl.program_id(1)
        h = tl.program_id(2)
        n = tl.load(lens_ptr + s_idx)
        if tile * BLOCK_M < n:
            row0 = tl.load(starts_ptr + s_idx)
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            d = tl.arange(0, DP)
            row_mask = rows < n
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DP], tl.float32)
            part = 0
            while part < num_parts:
                at = (part * num_rows + row0 + rows) * H + h
                m_part = tl.load(stats_ptr + at * 2, mask=row_mask, other=float("-inf"))
                total_part = tl.load(stats_ptr + at * 2 + 1, mask=row_mask, other=0.0)
                acc_part = tl.load(part_ptr + at[:, None] * DP + d[None, :],
                                   mask=row_mask[:, None], other=0.0)
                m_new = tl.maximum(m, m_part)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)  # (the parts' maxima are in base 2)
                beta = tl.exp2(m_part - m_safe)
                total = total * alpha + total_part * beta
                acc = acc * alpha[:, None] + acc_part * beta[:, None]
                m = m_new
                part += 1
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(o_ptr + (row0 + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & (d[None, :] < D))


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, blocks_ptr, offsets_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct,
                         stride_ch, stride_vcb, stride_vct, stride_vch,
                         H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
        t = tl.program_id(0)
        block = tl.load(blocks_ptr + t).to(tl.int64)  # its offset may pass 2**31
        slot = tl.load(offsets_ptr + t)
        h = tl.arange(0, HP)
        d = tl.arange(0, DP)
        mask = (h[:, None] < H) & (d[None, :] < D)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(kc_ptr + block * stride_cb + slot * stride_ct + h[:, None] * stride_ch
                 + d[None, :], k, mask=mask)
        tl.store(vc_ptr + block * stride_vcb + slot * stride_vct + h[:, None] * stride_vch
                 + d[None, :], v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """k/v [T, Hkv, D] into their slots (slot_blocks[t], slot_offsets[t]) of the paged cache:
    one program per token, no host work (the indexed assignment it replaces may not be
    capturable in a CUDA graph)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_blocks, slot_offsets, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), H=num_kv_heads, D=head_dim,
        HP=_next_pow2(num_kv_heads), DP=_next_pow2(head_dim))


def warm_up(q_like: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scratch_block: int) -> None:
    """Compile every kernel now (start-up), not in the first request that needs it: a
    one-token decode, a two-token prefill and a KV store, all on the scratch block."""
    device = q_like.device
    q = torch.zeros(2, *q_like.shape[1:], dtype=q_like.dtype, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    table = torch.full((1, 1), scratch_block, dtype=torch.int32, device=device)
    kv = torch.zeros(2, *k_cache.shape[2:], dtype=k_cache.dtype, device=device)
    store_kv(kv, kv, k_cache, v_cache, table[0].repeat(2), torch.arange(2, dtype=torch.int32,
                                                                         device=device))
    paged_decode(q[:1], k_cache, v_cache, table, one)
    paged_prefill(q, k_cache, v_cache, table, one * 0, one * 2, one * 2, 2, parts=1)
    paged_prefill(q, k_cache, v_cache, table, one * 0, one * 2, one * 2, 2, parts=2)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, context_lens: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [num_blocks, block_size, Hkv, D] (strided views are fine);
    block_table [B, max_blocks] int32/int64; context_lens [B] (0: a padding row, output 0).
    Returns out [B, Hq, D]. Every tensor is read in place: this can run inside a CUDA graph."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    tile = max(block_size, DECODE_KEYS)
    _decode_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, out, block_table, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), head_dim ** -0.5 * LOG2E, G=group, GP=max(16, _next_pow2(group)),
        D=head_dim, DP=max(16, _next_pow2(head_dim)), BLOCK_SIZE=block_size, TILE=tile,
        PRECISION=_precision(q), num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                  context_lens: torch.Tensor, max_q_len: int,
                  out: torch.Tensor | None = None, parts: int | None = None) -> torch.Tensor:
    """q [T, Hq, D], the flat batch; request s owns rows [q_starts[s], q_starts[s] + q_lens[s])
    at positions [context_lens[s] - q_lens[s], context_lens[s]) and attends causally to its
    context through block_table[s]. Rows no request owns are left as they are in `out`.
    A short chunk over a long context (the rest of a prompt after a pool hit) has its
    context split into `parts` run side by side, their results folded by a second kernel;
    `parts` None: as `prefill_parts` says for a context as long as the table is wide (the
    runner trims it to the longest context's blocks)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    block_m = PREFILL_TILE  # one variant: no compile on a new chunk length while serving
    tiles = triton.cdiv(max_q_len, block_m)
    if parts is None:
        parts = prefill_parts(q.device, q_lens.shape[0] * tiles * num_heads,
                              block_table.shape[1] * block_size)
    dp = max(16, _next_pow2(head_dim))
    part_out = stats = _unused(q.device)
    if parts > 1:
        part_out = torch.empty((parts, q.shape[0], num_heads, dp), dtype=torch.float32,
                               device=q.device)
        stats = torch.empty((parts, q.shape[0], num_heads, 2), dtype=torch.float32,
                            device=q.device)
    _prefill_kernel[(q_lens.shape[0], tiles, num_heads * parts)](
        q, k_cache, v_cache, out, part_out, stats, block_table, q_starts, q_lens, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_table.stride(0), q.shape[0], parts, head_dim ** -0.5 * LOG2E, H=num_heads,
        G=num_heads // num_kv_heads, D=head_dim, DP=dp, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=PREFILL_KEYS, PRECISION=_precision(q), num_warps=PREFILL_WARPS,
        num_stages=PREFILL_STAGES)
    if parts > 1:
        _combine_kernel[(q_lens.shape[0], tiles, num_heads)](
            out, part_out, stats, q_starts, q_lens, out.stride(0), out.stride(1), q.shape[0],
            parts, H=num_heads, D=head_dim, DP=dp, BLOCK_M=block_m)
    return out


DECODE_KEYS = 64  # keys of a decode program's tile (at least a block)
DECODE_WARPS, DECODE_STAGES = 4, 2  # its launch: warps, and the key loop's pipeline depth
PREFILL_TILE = 64  # query rows of a prefill program
PREFILL_KEYS = 64  # keys of a prefill program's tile
PREFILL_WARPS, PREFILL_STAGES = 4, 2  # its launch: warps, and the key loop's pipeline depth
MAX_PARTS = 16
PART_KEYS = 512  # the fewest keys a part of a split context walks
# programs (request tiles x heads x parts) per SM a split context aims at. H100, 64 new
# tokens of Llama-8B's heads over 8k / 32k keys, GPU time by parts (scripts/parts_probe.py):
# 9 parts (2 per SM) 91 / 376 us, 16 (4 per SM) 84 / 241 us, 32: 113 / 272 us
PROGRAMS_PER_SM = 4


def prefill_parts(device: torch.device, programs: int, max_context: int) -> int:
    """Into how many parts a prefill splits its contexts: enough for `programs` (request
    tiles x heads) x parts to fill the GPU's SMs about PROGRAMS_PER_SM times over, each part
    at least PART_KEYS keys long; 1 where the programs fill it already (a long chunk) or
    on a CPU."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(MAX_PARTS, -(-PROGRAMS_PER_SM * sms // programs), max_context // PART_KEYS))


@functools.lru_cache(maxsize=None)
def _unused(device: torch.device) -> torch.Tensor:
    """What the prefill kernel takes for its parts' buffers when it runs one part."""
    return torch.empty(2, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
