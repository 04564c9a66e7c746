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

The router's greedy top k (softmax scores) is one launch too (`route_softmax_topk`).
The layout is built on the device in two small launches, with a running sum between them
and no sort: `_count_kernel` (each program counts a chunk of assignments per expert) and
`_place_kernel` (an assignment's row is its expert's first row plus the expert's
assignments before it). The number of tiles is bounded without looking at the routing
(cdiv(assignments, BLOCK_M) + experts), so the grids are fixed for a batch size and the
launches are graph-capturable; tiles past the used ones exit at once. The k assignments
of a token are summed at the end. Assignments routed to another rank's experts produce
zero rows. `SparseMoE.partial`'s loop over experts is the reference in tests (on CPU
through Triton's interpreter).
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


if HAS_TRITON:
    @triton.jit
    def _local_experts(chosen_ptr, first, num, CHUNK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                       E_PAD: tl.constexpr):
        """This program's assignments, their expert on this rank (NUM_EXPERTS: another
        rank's; -1: past the end) and their one-hot rows [CHUNK, E_PAD]."""
        a = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(chosen_ptr + a, mask=a < num, other=0).to(tl.int32) - first
        local = tl.where((e >= 0) & (e < NUM_EXPERTS), e, NUM_EXPERTS)
        local = tl.where(a < num, local, -1)
        return a, local, local[:, None] == tl.arange(0, E_PAD)[None, :]

    # the assignment and tile counts change with the batch: not specialized on (Triton would
    # compile a variant for counts of 1 and for multiples of 16, in whichever request has one)
    @triton.jit(do_not_specialize=["first", "num"])
    def _count_kernel(chosen_ptr, counts_ptr, first, num, CHUNK: tl.constexpr,
                      NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr):
        """counts[chunk, e]: how many of a chunk's assignments go to expert e."""
        _, _, onehot = _local_experts(chosen_ptr, first, num, CHUNK, NUM_EXPERTS, E_PAD)
        tl.store(counts_ptr + tl.program_id(0) * E_PAD + tl.arange(0, E_PAD),
                 tl.sum(onehot.to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["first", "num", "num_chunks", "num_tiles"])
    def _place_kernel(chosen_ptr, counts_ptr, ahead_ptr, row_ids_ptr, tile_expert_ptr, first,
                      num, num_chunks, num_tiles, CHUNK: tl.constexpr,
                      NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      TILE_BLOCK: tl.constexpr):
        """Each assignment to its row: its expert's first row (runs padded to BLOCK_M), plus
        the expert's assignments in earlier chunks, plus those earlier in this chunk. The
        programs also share out tile_expert (the expert whose run a tile lies in)."""
        chunk = tl.program_id(0)
        experts = tl.arange(0, E_PAD)
        ours = experts < NUM_EXPERTS
        # ahead: counts summed over chunks up to and including each one
        total = tl.load(ahead_ptr + (num_chunks - 1) * E_PAD + experts).to(tl.int32)
        padded = tl.where(ours, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        padded_end = tl.cumsum(padded, 0)
        before = (tl.load(ahead_ptr + chunk * E_PAD + experts).to(tl.int32)
                  - tl.load(counts_ptr + chunk * E_PAD + experts))
        a, local, onehot = _local_experts(chosen_ptr, first, num, CHUNK, NUM_EXPERTS, E_PAD)
        base = tl.sum(tl.where(onehot, (padded_end - padded + before)[None, :], 0), axis=1)
        within = tl.sum(tl.where(onehot, tl.cumsum(onehot.to(tl.int32), axis=0), 0), axis=1)
        tl.store(row_ids_ptr + base + within - 1, a, mask=(local >= 0) & (local < NUM_EXPERTS))
        for t0 in range(chunk * TILE_BLOCK, num_tiles, num_chunks * TILE_BLOCK):
            t = t0 + tl.arange(0, TILE_BLOCK)
            passed = (padded_end[None, :] <= (t * BLOCK_M)[:, None]) & ours[None, :]
            tl.store(tile_expert_ptr + t, tl.sum(passed.to(tl.int32), axis=1), mask=t < num_tiles)


    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, chosen_ptr, stride_logits, num_experts, scale,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                      NORMALIZE: tl.constexpr):
        """One token: softmax of its router logits in float32, the top k (largest first),
        their scores renormalised if asked, times the scaling factor."""
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        logits = tl.load(logits_ptr + t * stride_logits + e, mask=e < num_experts,
                         other=-float("inf")).to(tl.float32)
        scores = tl.exp(logits - tl.max(logits, axis=0))
        scores = scores / tl.sum(scores, axis=0)
        left = tl.where(e < num_experts, scores, -1.0)  # padding is never chosen
        slot = tl.arange(0, K_PAD)
        picked = tl.zeros([K_PAD], dtype=tl.float32)
        experts = tl.zeros([K_PAD], dtype=tl.int64)
        for i in tl.static_range(TOP_K):
            best = tl.argmax(left, axis=0)
            picked = tl.where(slot == i, tl.max(left, axis=0), picked)
            experts = tl.where(slot == i, best.to(tl.int64), experts)
            left = tl.where(e == best, -1.0, left)
        if NORMALIZE:
            picked = picked / (tl.sum(picked, axis=0) + 1e-20)
        picked = picked * scale
        tl.store(weights_ptr + t * TOP_K + slot, picked.to(weights_ptr.dtype.element_ty),
                 mask=slot < TOP_K)
        tl.store(chosen_ptr + t * TOP_K + slot, experts, mask=slot < TOP_K)


def route_softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool, scale: float,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy router in one launch: logits [T, E] -> (weights [T, k] in `dtype`, experts
    [T, k] int64), as SparseMoE.route computes them (softmax in float32, top k largest first,
    renormalised if `normalize`, times `scale`)."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=dtype, device=logits.device)
    chosen = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        assert logits.stride(1) == 1
        _route_kernel[(num_tokens,)](logits, weights, chosen, logits.stride(0), num_experts,
                                     scale, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                     E_PAD=triton.next_power_of_2(num_experts),
                                     NORMALIZE=normalize)
    return weights, chosen


# a program of the two routing launches holds [chunk, experts] one-hot rows: up to this many
ALIGN_ELEMENTS = 16384


def _sort_by_expert(chosen: torch.Tensor, first: int, num_experts: int, block_m: int):
    """(row_ids [tiles * block_m], tile_expert [tiles]) of the assignments `chosen` [T, k]
    to this rank's experts [first, first + num_experts), in four small launches (a fill,
    the counts per chunk, their running sums, the placing), no host sync. Within an
    expert's run, assignments keep their order."""
    num = chosen.numel()
    e_pad = triton.next_power_of_2(num_experts + 1)  # the last column: other ranks' experts
    chunk = max(1, min(128, ALIGN_ELEMENTS // e_pad))
    num_chunks = max(triton.cdiv(num, chunk), 1)
    # an upper bound whatever the routing: the used rows (at most num + E * (block_m - 1))
    num_tiles = triton.cdiv(num, block_m) + num_experts
    row_ids = torch.full((num_tiles * block_m,), -1, dtype=torch.int32, device=chosen.device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=chosen.device)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=chosen.device)
    chosen = chosen.contiguous()
    _count_kernel[(num_chunks,)](chosen, counts, first, num, CHUNK=chunk,
                                 NUM_EXPERTS=num_experts, E_PAD=e_pad)
    ahead = torch.cumsum(counts, 0)
    _place_kernel[(num_chunks,)](chosen, counts, ahead, row_ids, tile_expert, first, num,
                                 num_chunks, num_tiles, CHUNK=chunk,
                                 NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m,
                                 TILE_BLOCK=64)
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
