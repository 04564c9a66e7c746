"""How attention reads and writes the paged KV cache: chosen once, when the model is built.

- `TorchBackend`: gather a request's blocks and run `scaled_dot_product_attention` over
  them (the reference fields of `AttentionMetadata`); rope, norms and SwiGLU as plain
  torch ops. Runs anywhere; the kernels' reference in tests.
- `TritonBackend`: the paged Triton kernels, which read the block table in place
  (`AttentionMetadata.paged`), and fused kernels for rope, norms and SwiGLU. What a CUDA
  device with Triton runs.

A backend holds no state of its own: the model's layers share one.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shoal.util import to_device

# SDPA's backends on a GPU, cuDNN's left out: PyTorch tries it first on H100/H200 with a
# recent cuDNN, and it builds an execution plan for each new shape (hundreds of ms, per
# the reports of SGLang and MLX), so every new context length would pay one
GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchBackend:
    paged = False  # no kernels to warm up or capture
    fused = False  # rope, norms and SwiGLU as plain torch ops

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        """Write the step's new K and V [T, Hkv, D] into their slots."""
        k_cache[meta.slot_block_ids, meta.slot_offsets] = k
        v_cache[meta.slot_block_ids, meta.slot_offsets] = v

    def attend(self, q: torch.Tensor, meta, k_cache, v_cache) -> torch.Tensor:
        """q [T, Hq, D] -> [T, Hq, D]: each request's rows over its context, causally."""
        return attend_per_request(
            meta, torch.empty_like(q), k_cache.shape[1],
            lambda rows, table, ctxs: decode_attention(q[rows], table, ctxs, k_cache, v_cache),
            lambda rows, block_ids, ctx: _prefill(q[rows], block_ids, ctx, k_cache, v_cache))


def attend_per_request(meta, out: torch.Tensor, block_size: int, decode, prefill):
    """A step's attention request by request, on the host's copy of the layout: the
    one-token decodes together, `decode(rows, table [B, W], ctxs)` for their batch rows,
    each longer chunk on its own, `prefill(rows, block_ids, ctx)`; their results written
    into `out` [T, ...], which is returned (or, when every row decodes, in request order,
    decode's result itself)."""
    p = meta.paged
    starts, lens, ctxs = p.host
    table = p.block_table  # (int32 on a GPU: the kernels are compiled for it)
    decodes = [s for s, n in enumerate(lens) if n == 1]
    if len(decodes) == len(lens):  # steady-state decode: rows in request order
        return decode(slice(None), table, ctxs)
    if decodes:
        rows = to_device([starts[s] for s in decodes], out.device)
        out[rows] = decode(rows, table[decodes], [ctxs[s] for s in decodes])
    for s, (start, n, ctx) in enumerate(zip(starts, lens, ctxs)):
        if n > 1:
            rows = slice(start, start + n)
            out[rows] = prefill(rows, table[s, :-(-ctx // block_size)], ctx)
    return out


class TritonBackend:
    paged = True  # the runner packs the step's inputs for the kernels (PagedInputs)
    fused = True  # fused rope, add + RMSNorm and SwiGLU kernels

    def store(self, k, v, k_cache, v_cache, meta) -> None:
        from shoal.model.paged_attention import store_kv
        store_kv(k, v, k_cache, v_cache, meta.slot_block_ids, meta.slot_offsets)

    def attend(self, q: torch.Tensor, meta, k_cache, v_cache) -> torch.Tensor:
        from shoal.model.paged_attention import paged_decode, paged_prefill
        p = meta.paged
        if p.max_query_len == 1:
            return paged_decode(q, k_cache, v_cache, p.block_table, p.context_lens)
        return paged_prefill(q, k_cache, v_cache, p.block_table, p.query_starts, p.query_lens,
                             p.context_lens, p.max_query_len, parts=p.parts)


def default_backend(device: torch.device) -> TorchBackend | TritonBackend:
    """The kernels on a CUDA device with Triton; the torch ops anywhere else."""
    from shoal.model.paged_attention import HAS_TRITON
    if device.type == "cuda" and HAS_TRITON:
        return TritonBackend()
    return TorchBackend()


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """block_ids [..., nb] of a cache [N, bs, Hkv, D] -> [..., Hkv, nb * bs, D]."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    blocks = blocks.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])
    return blocks.transpose(-3, -2)


def _prefill(q, block_ids, ctx: int, k_cache, v_cache):
    """q [n, Hq, D], the last n of the request's `ctx` positions, attends to the context
    [0, ctx) causally; `block_ids` [cdiv(ctx, block_size)]."""
    keys = gather_blocks(k_cache, block_ids)[:, :ctx]  # [Hkv, ctx, D]
    return causal_attention(q, keys, gather_blocks(v_cache, block_ids)[:, :ctx])


def causal_attention(q, keys, values, scale: float | None = None):
    """q [n, Hq, D], the last n of the ctx positions of keys [Hkv, ctx, D] and values
    [Hkv, ctx, Dv], attends to them causally -> [n, Hq, Dv]. `scale`: of the logits
    (1/sqrt(D) when None)."""
    n, ctx, dv = q.shape[0], keys.shape[1], values.shape[-1]
    q = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    flash = _flash_runs(q, keys, values)
    if flash and dv != keys.shape[-1]:  # flash takes no values narrower than the keys:
        values = F.pad(values, (0, keys.shape[-1] - dv))  # MLA's (128 of 192) padded
    if n == ctx:
        o = _sdpa(q, keys, values, is_causal=True, scale=scale)
    elif flash:
        # Flash takes no mask, and with fewer queries than keys its causal window is
        # aligned to the end, as needed here; else the memory-efficient kernel runs the
        # mask, 2-4x slower at 8k tokens (scripts/mla_sdpa_probe.py). (SDPA's lower-right
        # causal bias would choose the same, but importing it imports dynamo.)
        o = _flash_causal(q, keys, values, scale)
    else:
        # Query i sits at position ctx - n + i and sees keys j <= that position.
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # [n, ctx]
        o = _sdpa(q, keys, values, attn_mask=mask, scale=scale)
    return o[..., :dv].squeeze(0).transpose(0, 1)  # [n, Hq, Dv]


def _flash_runs(q, keys, values) -> bool:
    """Whether flash attention takes these [1, H, len, D] queries, keys and values (a GPU
    of compute capability 8.0 or later with SDPA's flash backend on, half precision, as many
    key heads as query heads, D a multiple of 8 up to 256, values no wider than the keys)."""
    d = keys.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and keys.shape[1] == q.shape[1] and d % 8 == 0 and d <= 256
            and values.shape[-1] <= d and torch.backends.cuda.flash_sdp_enabled()
            and _capability(q.device.index) >= (8, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """A CUDA device's compute capability (asked once per device)."""
    return torch.cuda.get_device_capability(index)


def _flash_causal(q, keys, values, scale: float | None):
    """Flash attention, causal, over [1, H, len, D] tensors; with fewer queries than keys
    its window is aligned to the end (query i sees keys up to ctx - n + i)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True,
                                                              scale=scale)[0]


def decode_attention(q, table, ctxs: list[int], k_cache, v_cache, scale: float | None = None):
    """q [B, Hq, D]: one query per request at the end of its context of ctxs[b] tokens;
    `table` [B, W] its blocks (padded with any block: masked) -> [B, Hq, Dv]. `scale`: of
    the logits (1/sqrt(D) when None)."""
    ctx = max(ctxs)
    keys = gather_blocks(k_cache, table)[:, :, :ctx]  # [B, Hkv, ctx, D]
    values = gather_blocks(v_cache, table)[:, :, :ctx]
    mask = None
    if min(ctxs) != ctx:
        lens = to_device(ctxs, q.device)
        mask = (torch.arange(ctx, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    o = _sdpa(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale)
    return o.squeeze(2)  # [B, Hq, Dv]


def _sdpa(q, keys, values, **kw):
    """SDPA over [B, H, len, D] tensors, grouped when the key heads are fewer (the flag set
    alone may bar a kernel that needs none); on a GPU through `GPU_SDPA`'s backends."""
    with sdpa_kernel(GPU_SDPA) if q.is_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, keys, values,
                                              enable_gqa=keys.shape[1] != q.shape[1], **kw)
