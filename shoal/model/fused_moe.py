"""The routed experts in two Triton launches (a grouped GEMM per projection), no host sync.

Each token's k choices are "assignments" (a = token * k + slot). They are sorted by expert
and each expert's run is padded to whole tiles of BLOCK_M rows, so a tile belongs to one
expert (BLOCK_M 16 for a decode batch, a few rows per expert; more for a prefill chunk,
where each tile re-reads its expert's weights):

    sorted rows   | e0 e0 e0 -- | e1 e1 e1 e1 | e1 -- -- -- | e3 -- -- -- | (unused tiles)
    tile_expert   |     0       |      1      |      1      |      3      | E (= skip)
    row_ids       | a  a  a  -1 | a  a  a  a  | a  -1 -1 -1 | a  -1 -1 -1 |

    gate_up   grid (tiles, I / BLOCK_N): rows of x gathered by row_ids, times the tile's
              expert's gate and up columns; silu(gate) * up into the tile's rows of `inter`
    down      grid (tiles, hidden / BLOCK_N): inter times the expert's down weights, times
              the assignment's router weight, written to the assignment's row of `out`

The number of tiles is bounded without looking at the routing (cdiv(assignments, BLOCK_M)
+ experts), so the grid is fixed for a batch size and the launch is graph-capturable;
tiles past the used ones exit at once. The k assignments of a token are summed at the end.
Assignments routed to another rank's experts produce zero rows. `SparseMoE.partial`'s loop
over experts is the reference in tests (on CPU through Triton's interpreter).
"""

from __future__ import annotations

import torch

from shoal.model.paged_attention import HAS_TRITON, _precision

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of both launches, by the mean rows an
# expert gets (up to the key); scripts/moe_tune.py sweeps them on a GPU
# (an H100's best for 16 and 64: docs/benchmarks.md; 128 for prefill chunks is untuned)
TILES = {16: (16, 64, 128, 4, 3), 64: (64, 64, 64, 4, 3), None: (128, 128, 64, 8, 3)}


def pick_tiles(num_assignments: int, num_experts: int) -> tuple[int, int, int, int, int]:
    rows = num_assignments / max(num_experts, 1)
    return next(t for limit, t in TILES.items() if limit is None or rows <= limit)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(row_ids_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """This program's rows, their assignments (-1: none), which are real, its output
        columns and the offsets of a step along the reduced dimension."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        assignment = tl.load(row_ids_ptr + rows)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, assignment, assignment >= 0, n, tl.arange(0, BLOCK_K)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, inter_ptr, row_ids_ptr, tile_expert_ptr, stride_x,
                        stride_we, stride_wn, stride_inter, NUM_EXPERTS: tl.constexpr,
                        TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
        e = tl.load(tile_expert_ptr + tl.program_id(0))
        if e < NUM_EXPERTS:
            rows, assignment, valid, n, kk = _tile(row_ids_ptr, BLOCK_M, BLOCK_N, BLOCK_K)
            token = tl.where(valid, assignment // TOP_K, 0).to(tl.int64)
            w = w_ptr + e.to(tl.int64) * stride_we
            gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, HIDDEN, BLOCK_K):
                k = k0 + kk
                a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :],
                            mask=valid[:, None] & (k[None, :] < HIDDEN), other=0.0)
                w_mask = (k[:, None] < HIDDEN) & (n[None, :] < INTER)
                wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
                wu = tl.load(w + (INTER + n[None, :]) * stride_wn + k[:, None], mask=w_mask,
                             other=0.0)
                gate += tl.dot(a, wg, input_precision=PRECISION).to(tl.float32)
                up += tl.dot(a, wu, input_precision=PRECISION).to(tl.float32)
            h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
            tl.store(inter_ptr + rows[:, None].to(tl.int64) * stride_inter + n[None, :],
                     h.to(inter_ptr.dtype.element_ty),
                     mask=valid[:, None] & (n[None, :] < INTER))

    @triton.jit
    def _down_kernel(inter_ptr, w_ptr, out_ptr, weights_ptr, row_ids_ptr, tile_expert_ptr,
                     stride_inter, stride_we, stride_wn, stride_out,
                     NUM_EXPERTS: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
        e = tl.load(tile_expert_ptr + tl.program_id(0))
        if e < NUM_EXPERTS:
            rows, assignment, valid, n, kk = _tile(row_ids_ptr, BLOCK_M, BLOCK_N, BLOCK_K)
            w = w_ptr + e.to(tl.int64) * stride_we
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                k = k0 + kk
                a = tl.load(inter_ptr + rows[:, None].to(tl.int64) * stride_inter + k[None, :],
                            mask=valid[:, None] & (k[None, :] < INTER), other=0.0)
                wd = tl.load(w + n[None, :] * stride_wn + k[:, None],
                             mask=(k[:, None] < INTER) & (n[None, :] < HIDDEN), other=0.0)
                acc += tl.dot(a, wd, input_precision=PRECISION).to(tl.float32)
            weight = tl.load(weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]
            tl.store(out_ptr + tl.where(valid, assignment, 0).to(tl.int64)[:, None] * stride_out
                     + n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=valid[:, None] & (n[None, :] < HIDDEN))


def _sort_by_expert(chosen: torch.Tensor, first: int, num_experts: int, block_m: int):
    """(row_ids [tiles * block_m], tile_expert [tiles]) of the assignments `chosen` [T, k]
    to this rank's experts [first, first + num_experts), all on the device."""
    local = chosen.flatten() - first
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    num = local.numel()
    order = torch.argsort(local, stable=True)  # assignments by expert, others' last
    # (not bincount: its size depends on the values, which a CUDA graph cannot wait for)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=chosen.device).scatter_add_(
        0, local, torch.ones_like(local))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start_in_order = torch.cumsum(counts, 0) - counts  # an expert's first place in `order`
    e = local[order]
    mine = e < num_experts
    e_safe = e.clamp(max=num_experts - 1)
    slot = padded_end[e_safe] - padded[e_safe] + torch.arange(num, device=chosen.device) \
        - start_in_order[e_safe]
    # an upper bound whatever the routing: the used slots (at most num + E * (block_m - 1))
    # never reach the last one, where other ranks' assignments are parked as -1
    num_tiles = -(-num // block_m) + num_experts
    row_ids = torch.full((num_tiles * block_m,), -1, dtype=torch.int64, device=chosen.device)
    row_ids[torch.where(mine, slot, num_tiles * block_m - 1)] = torch.where(mine, order, -1)
    tile_start = torch.arange(num_tiles, device=chosen.device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return row_ids, tile_expert


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, chosen: torch.Tensor, first: int,
                  tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [T, hidden]; gate_up [E, 2I, hidden]; down [E, hidden, I] (this rank's experts
    first..first+E-1); weights/chosen [T, k] (the router's) -> this rank's share [T, hidden].
    `tiles`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); by default `pick_tiles`."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, chosen.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k, warps, stages = tiles or pick_tiles(chosen.numel(), num_experts)
    row_ids, tile_expert = _sort_by_expert(chosen, first, num_experts, block_m)
    num_tiles = tile_expert.shape[0]
    hidden_rows = torch.empty(num_tiles * block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    x, weights = x.contiguous(), weights.contiguous()
    precision = _precision(x)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x, gate_up, hidden_rows, row_ids, tile_expert, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), hidden_rows.stride(0), NUM_EXPERTS=num_experts, TOP_K=top_k,
        HIDDEN=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, num_warps=warps, num_stages=stages)
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        hidden_rows, down, out, weights, row_ids, tile_expert, hidden_rows.stride(0),
        down.stride(0), down.stride(1), out.stride(0), NUM_EXPERTS=num_experts, HIDDEN=hidden,
        INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        num_warps=warps, num_stages=stages)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
