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
    rope_(qkv, cos, sin, ...)           q * cos + rotate_half(q) * sin, k likewise, in place

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
    def _rope_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_t, stride_cos, stride_sin,
                     num_heads, HALF: tl.constexpr, HP: tl.constexpr, HALFP: tl.constexpr):
        """Rows of q heads then k heads (contiguous at the start of a qkv row), rotated."""
        t = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HP)
        j = tl.arange(0, HALFP)
        mask = (heads[:, None] < num_heads) & (j[None, :] < HALF)
        first = qkv_ptr + t * stride_t + heads[:, None] * (2 * HALF) + j[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        # cos/sin rows are [cos(f), cos(f)]: the first half serves both halves
        c = tl.load(cos_ptr + t * stride_cos + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_sin + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounds
        out1 = (a1 * c).to(dtype).to(tl.float32) + (-(a2 * s)).to(dtype).to(tl.float32)
        out2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
        tl.store(first, out1.to(dtype), mask=mask)
        tl.store(first + HALF, out2.to(dtype), mask=mask)


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


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
          num_kv_heads: int, head_dim: int) -> None:
    """Rotate the q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place; cos/sin [T, D]."""
    if qkv.shape[0] == 0:
        return
    heads, half = num_q_heads + num_kv_heads, head_dim // 2
    _rope_kernel[(qkv.shape[0],)](qkv, cos, sin, qkv.stride(0), cos.stride(0), sin.stride(0),
                                  heads, HALF=half, HP=_next_pow2(heads),
                                  HALFP=_next_pow2(half))
