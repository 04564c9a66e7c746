"""The layer's elementwise work in one Triton kernel each, for the GPU path.

In PyTorch ops a decoder layer launches ~30 small kernels besides its matmuls and its
attention (RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply, scale); at
decode batch sizes each reads a few KiB, so the launches, not the bytes, are the cost.
Here each is one kernel, computing in float32 and rounding to the model's dtype where
PyTorch's ops round, so they stand in for the ops in `shoal.model.llama` (the reference,
and the CPU path). One exception: the compiled RoPE kernel rounds once where PyTorch
rounds each product and then the sum (measured on the H200: 23% of bfloat16 values one
ulp apart), so it is within half an ulp of the exact value, where the reference may be an
ulp further off.

    rms_norm(x, w, eps)                 RMSNorm.forward
    add_rms_norm(x, residual, w, eps)   residual + x, then its RMSNorm: both returned
    silu_mul(gate_up)                   F.silu(gate) * up of the halves of gate_up
    rope_store(qkv, cos, sin, ...)      q * cos + rotate_half(q) * sin in place; k likewise
                                        and v as it is written into the token's cache slot
                                        (apply_rope, then the backend's store: store_kv)
    mla_rope_store(q, kv_a, ...)        MLA's step after its projections: the query heads'
                                        rotary parts rotated, the latent's RMSNorm and the
                                        rotated key written into the token's cache slot

Tested against those ops on random inputs (tests/test_fused_ops.py; on CPU through
Triton's interpreter).
"""

from __future__ import annotations

import torch

from shoal.model.paged_attention import HAS_TRITON, _next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res,
                         stride_out, stride_sum, n, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # the sum in the model's dtype, as `residual + x` rounds it
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        h = x.to(tl.float32)
        variance = tl.sum(h * h, axis=0) / n
        h = (h * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * h.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # F.silu rounds to the dtype
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x1, x2, c, s):
        """(x1 cos - x2 sin, x2 cos + x1 sin), each product rounded to x's dtype (as
        apply_rope's ops round them: x * cos + rotate_half(x) * sin,
        rotate_half(x) = [-x2, x1])."""
        dtype = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        out1 = (a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)
        out2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
        return out1.to(dtype), out2.to(dtype)

    @triton.jit
    def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, blocks_ptr, offsets_ptr,
                           stride_t, stride_cos, stride_sin, stride_kb, stride_kt, stride_kh,
                           stride_vb, stride_vt, stride_vh, num_q_heads, num_kv_heads,
                           HALF: tl.constexpr, HP: tl.constexpr, HALFP: tl.constexpr,
                           KVP: tl.constexpr, VP: tl.constexpr):
        """One token's qkv row: its q heads rotated in place, its k heads rotated and its v
        heads copied into the token's cache slot (block, offset)."""
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HP)  # q heads, then k heads
        j = tl.arange(0, HALFP)
        jm = j[None, :] < HALF
        rotated = (heads[:, None] < num_q_heads + num_kv_heads) & jm
        first = qkv_ptr + t * stride_t + heads[:, None] * (2 * HALF) + j[None, :]
        x1 = tl.load(first, mask=rotated, other=0.0)
        x2 = tl.load(first + HALF, mask=rotated, other=0.0)
        # cos/sin rows are [cos(f), cos(f)]: the first half serves both halves
        c = tl.load(cos_ptr + t * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_sin + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        out1, out2 = _rotate(x1, x2, c, s)
        is_q = (heads[:, None] < num_q_heads) & jm
        tl.store(first, out1, mask=is_q)
        tl.store(first + HALF, out2, mask=is_q)
        block = tl.load(blocks_ptr + t).to(tl.int64)  # its offset may pass 2**31
        offset = tl.load(offsets_ptr + t).to(tl.int64)
        is_k = rotated & (heads[:, None] >= num_q_heads)
        k_slot = (kc_ptr + block * stride_kb + offset * stride_kt
                  + (heads[:, None] - num_q_heads) * stride_kh + j[None, :])
        tl.store(k_slot, out1.to(kc_ptr.dtype.element_ty), mask=is_k)
        tl.store(k_slot + HALF, out2.to(kc_ptr.dtype.element_ty), mask=is_k)
        kv = tl.arange(0, KVP)[:, None]  # v heads
        d = tl.arange(0, VP)[None, :]
        vm = (kv < num_kv_heads) & (d < 2 * HALF)
        v = tl.load(qkv_ptr + t * stride_t + (num_q_heads + num_kv_heads + kv) * (2 * HALF) + d,
                    mask=vm, other=0.0)
        tl.store(vc_ptr + block * stride_vb + offset * stride_vt + kv * stride_vh + d,
                 v.to(vc_ptr.dtype.element_ty), mask=vm)

    @triton.jit
    def _mla_rope_store_kernel(q_ptr, q_rot_ptr, kv_a_ptr, w_ptr, cos_ptr, sin_ptr, cache_ptr,
                               blocks_ptr, offsets_ptr, stride_q, stride_qh, stride_qr,
                               stride_qrh, stride_kv_a, stride_cos, stride_sin,
                               stride_cache_block, stride_cache_slot, num_heads, eps,
                               NOPE: tl.constexpr, LATENT: tl.constexpr, LATENTP: tl.constexpr,
                               HALF: tl.constexpr, HALFP: tl.constexpr, HP: tl.constexpr,
                               INTERLEAVED: tl.constexpr):
        """One token: its query heads' rotary parts into q_rot; RMSNorm(latent) and the
        rotated key into its cache slot. Interleaved pairs (2i, 2i+1) come out as (all
        evens, all odds), as apply_rope writes them."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, HALFP)
        jm = j < HALF
        c = tl.load(cos_ptr + t * stride_cos + j, mask=jm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + j, mask=jm, other=0.0).to(tl.float32)
        first = 2 * j if INTERLEAVED else j  # where x1 and x2 of pair j are
        second = 2 * j + 1 if INTERLEAVED else j + HALF
        heads = tl.arange(0, HP)
        hm = (heads[:, None] < num_heads) & jm[None, :]
        src = q_ptr + t * stride_q + heads[:, None] * stride_qh + NOPE
        x1 = tl.load(src + first[None, :], mask=hm, other=0.0)
        x2 = tl.load(src + second[None, :], mask=hm, other=0.0)
        out1, out2 = _rotate(x1, x2, c[None, :], s[None, :])
        dst = q_rot_ptr + t * stride_qr + heads[:, None] * stride_qrh + j[None, :]
        tl.store(dst, out1, mask=hm)
        tl.store(dst + HALF, out2, mask=hm)
        # the cache entry: [RMSNorm(latent) | rotated key]
        block = tl.load(blocks_ptr + t).to(tl.int64)
        offset = tl.load(offsets_ptr + t).to(tl.int64)
        slot = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
        cols = tl.arange(0, LATENTP)
        cm = cols < LATENT
        latent = tl.load(kv_a_ptr + t * stride_kv_a + cols, mask=cm, other=0.0)
        h = latent.to(tl.float32)
        h = (h * tl.math.rsqrt(tl.sum(h * h, axis=0) / LATENT + eps)).to(latent.dtype)
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        tl.store(slot + cols, (w * h.to(tl.float32)).to(cache_ptr.dtype.element_ty), mask=cm)
        key = kv_a_ptr + t * stride_kv_a + LATENT
        k1, k2 = _rotate(tl.load(key + first, mask=jm, other=0.0),
                         tl.load(key + second, mask=jm, other=0.0), c, s)
        tl.store(slot + LATENT + j, k1.to(cache_ptr.dtype.element_ty), mask=jm)
        tl.store(slot + LATENT + HALF + j, k2.to(cache_ptr.dtype.element_ty), mask=jm)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x [..., n] (last dim contiguous)."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), 0,
                                           out.stride(0), 0, rows.shape[1], eps,
                                           HAS_RESIDUAL=False, BLOCK=_next_pow2(rows.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x) of [T, n] rows."""
    out, total = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, total, x.stride(0),
                                        residual.stride(0), out.stride(0), total.stride(0),
                                        x.shape[1], eps, HAS_RESIDUAL=True,
                                        BLOCK=_next_pow2(x.shape[1]))
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, gate_up [T, 2n] = [gate | up]."""
    n = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _next_pow2(n))
    if gate_up.shape[0]:
        _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
               num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
    """Rotate the q heads of qkv [T, (Hq + 2 Hkv) * D] in place (cos/sin [T, D]), and write
    each token's rotated k heads and its v heads into its slot (slot_blocks[t],
    slot_offsets[t]) of k/v_cache [blocks, block_size, Hkv, D], strided views are fine (as
    store_kv; the k heads of qkv are left as they were): one launch, not two."""
    if qkv.shape[0] == 0:
        return
    half = head_dim // 2
    _rope_store_kernel[(qkv.shape[0],)](
        qkv, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets, qkv.stride(0),
        cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), num_q_heads, num_kv_heads,
        HALF=half, HP=_next_pow2(num_q_heads + num_kv_heads), HALFP=_next_pow2(half),
        KVP=_next_pow2(num_kv_heads), VP=_next_pow2(head_dim))


def mla_rope_store(q: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                   slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, nope: int,
                   interleaved: bool) -> torch.Tensor:
    """MLA's elementwise step in one launch. q [T, H, nope + R] (read only), kv_a [T, L + R]
    (the latent, then the rotary key), cos/sin [T, R]; cache [blocks, block_size, 1, L + R].
    Writes each token's [RMSNorm(latent) * norm_weight | rope(key)] into its slot and
    returns the queries' rotary parts rotated, [T, H, R]."""
    num_tokens, heads, width = q.shape
    rope = width - nope
    latent = kv_a.shape[1] - rope
    q_rot = torch.empty(num_tokens, heads, rope, dtype=q.dtype, device=q.device)
    if num_tokens:
        assert q.stride(2) == kv_a.stride(1) == cache.stride(3) == 1
        assert cos.stride(1) == sin.stride(1) == 1
        _mla_rope_store_kernel[(num_tokens,)](
            q, q_rot, kv_a, norm_weight, cos, sin, cache, slot_blocks, slot_offsets,
            q.stride(0), q.stride(1), q_rot.stride(0), q_rot.stride(1), kv_a.stride(0),
            cos.stride(0), sin.stride(0), cache.stride(0), cache.stride(1), heads, eps,
            NOPE=nope, LATENT=latent, LATENTP=_next_pow2(latent), HALF=rope // 2,
            HALFP=_next_pow2(rope // 2), HP=_next_pow2(heads), INTERLEAVED=interleaved)
    return q_rot
