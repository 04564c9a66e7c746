"""The fused MoE kernels (two grouped-GEMM launches) against the experts one by one, on
random routings: ragged expert loads, experts no token picks, assignments to another
rank's experts, an empty batch. On CPU through Triton's interpreter; compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

fm = pytest.importorskip("shoal.model.fused_moe")
if not fm.HAS_TRITON:
    pytest.skip("Triton is not installed", allow_module_level=True)

from shoal.model.config import ModelConfig  # noqa: E402
from shoal.model.moe import SparseMoE  # noqa: E402
from shoal.model.shard import Shard  # noqa: E402
from tests.test_paged_attention import DEVICE  # noqa: E402

CFG = ModelConfig(vocab_size=16, hidden_size=48, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                  max_position_embeddings=64, tie_word_embeddings=False, family="qwen3_moe",
                  num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                  moe_layers=(0,))


# tiles of 16 rows (up to 16 rows an expert), of 64 (150 tokens) and of 128 (400, rank 1 of 2)
CASES = [(1, 0, 1, torch.float32), (37, 0, 1, torch.float32), (21, 1, 2, torch.float32),
         (0, 0, 1, torch.float32), (150, 0, 1, torch.float32), (400, 1, 2, torch.float32)] + (  # bfloat16 on a GPU only (the interpreter has none)
    [(300, 0, 1, torch.bfloat16)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("num_tokens, rank, size, dtype", CASES)
@torch.no_grad()
def test_fused_experts_match_one_by_one(num_tokens, rank, size, dtype):
    g = torch.Generator().manual_seed(num_tokens + rank)
    moe = SparseMoE(CFG, Shard(rank=rank, size=size), backend=None).to(DEVICE, dtype)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(num_tokens, CFG.hidden_size, generator=g).to(DEVICE, dtype)
    chosen = torch.argsort(torch.rand(num_tokens, 8, generator=g), dim=1)[:, :3].to(DEVICE)
    chosen[chosen == 5] = 6  # expert 5 is never picked (two slots may now share expert 6)
    weights = torch.rand(num_tokens, 3, generator=g).to(DEVICE, dtype)
    out = fm.fused_experts(x, moe.gate_up, moe.down, weights, chosen, moe.first)
    ref = moe.experts_one_by_one(x, weights, chosen)
    assert out.shape == (num_tokens, CFG.hidden_size) and (num_tokens == 0 or ref.abs().sum() > 0)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        return
    # half precision: the kernel accumulates in float32 and rounds once, the loop rounds at
    # each op; against the float64 answer on the same weights it is as close as the loop
    exact = moe.double().experts_one_by_one(x.double(), weights.double(), chosen)
    err = [float((y.double() - exact).norm() / exact.norm()) for y in (out, ref)]
    assert err[0] < 1e-2 and err[0] <= 1.5 * err[1], err


def sorted_by_expert(chosen: torch.Tensor, first: int, num_experts: int, block_m: int):
    """The layout _sort_by_expert must give, in plain Python: each expert's assignments in
    order, its run padded with -1 to whole tiles; unused tiles last (expert E)."""
    flat = chosen.flatten().tolist()
    rows, tile_expert = [], []
    for e in range(num_experts):
        run = [a for a, x in enumerate(flat) if x - first == e]
        num_tiles = -(-len(run) // block_m)
        rows += run + [-1] * (num_tiles * block_m - len(run))
        tile_expert += [e] * num_tiles
    total_tiles = -(-len(flat) // block_m) + num_experts
    rows += [-1] * (total_tiles * block_m - len(rows))
    return rows, tile_expert + [num_experts] * (total_tiles - len(tile_expert))


@pytest.mark.parametrize("block_m", [16, 64])
def test_sorted_rows_cover_each_assignment_once(block_m):
    chosen = torch.tensor([[0, 3], [3, 1], [7, 3], [3, 0]])  # rank 0 of 2 holds experts 0-3
    row_ids, tile_expert = fm._sort_by_expert(chosen.to(DEVICE), first=0, num_experts=4,
                                              block_m=block_m)
    used = row_ids[row_ids >= 0].tolist()
    assert sorted(used) == [0, 1, 2, 3, 5, 6, 7]  # every assignment to experts 0-3; 4 is 7's
    tiles = row_ids.view(-1, block_m).cpu()
    for t, e in enumerate(tile_expert.tolist()):
        if e < 4:
            assert all(int(chosen.flatten()[a]) == e for a in tiles[t].tolist() if a >= 0)
        else:
            assert (tiles[t] < 0).all()


# one chunk of assignments and several (a program places up to 128; 64 of 256 experts), a rank
# that holds the last experts of 64, experts no token picks
@pytest.mark.parametrize("num_tokens, k, num_experts, first, block_m",
                         [(5, 2, 8, 0, 16), (300, 3, 8, 4, 16), (70, 6, 64, 0, 16),
                          (130, 8, 32, 32, 64), (40, 8, 256, 0, 16)])
def test_sorted_rows_equal_the_plain_layout(num_tokens, k, num_experts, first, block_m):
    g = torch.Generator().manual_seed(num_tokens)
    total = first + num_experts + (4 if first else 0)  # other ranks' experts after ours too
    chosen = torch.argsort(torch.rand(num_tokens, total, generator=g), dim=1)[:, :k]
    chosen[chosen == first + 1] = first + 2  # expert first+1 is never picked
    row_ids, tile_expert = fm._sort_by_expert(chosen.to(DEVICE), first, num_experts, block_m)
    rows, experts = sorted_by_expert(chosen, first, num_experts, block_m)
    assert row_ids.tolist() == rows
    assert tile_expert.tolist() == experts


@pytest.mark.parametrize("experts, k, normalize, scale, dtype", [
    (8, 2, True, 1.0, torch.float32), (64, 6, False, 1.0, torch.float32),
    (128, 8, True, 2.5, torch.float32), (60, 4, False, 16.0, torch.float32)] + (
    [(128, 8, True, 1.0, torch.bfloat16), (64, 6, False, 1.0, torch.bfloat16)]
    if DEVICE == "cuda" else []))
@torch.no_grad()
def test_the_router_kernel_matches_route(experts, k, normalize, scale, dtype):
    """The greedy router in one launch: the same experts, largest first, and the same
    weights (softmax in float32, renormalised, scaled) as SparseMoE.route (in half
    precision: experts whose scores tie may come in another order or be swapped for one
    another; their scores, so their weights, are the same)."""
    from dataclasses import replace

    import torch.nn.functional as F
    cfg = replace(CFG, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=normalize,
                  routed_scaling_factor=scale)
    g = torch.Generator().manual_seed(experts * k)
    moe = SparseMoE(cfg, Shard(), backend=None).to(DEVICE, dtype)
    moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) * 3)  # decisive
    x = torch.randn(37, cfg.hidden_size, generator=g).to(DEVICE, dtype)
    ref_weights, ref_chosen = moe.route(x)
    logits = F.linear(x, moe.gate.weight)
    weights, chosen = fm.route_softmax_topk(logits, k, normalize, scale, dtype)
    if dtype == torch.float32:
        assert torch.equal(chosen, ref_chosen)
    else:  # half logits tie often, and torch.topk orders ties as it likes: equal scores
        scores = torch.softmax(logits.float(), dim=-1)
        assert torch.equal(scores.gather(1, chosen), scores.gather(1, ref_chosen))
        assert (chosen.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts
    assert weights.dtype == ref_weights.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights, ref_weights, rtol=tol, atol=tol)
    assert fm.route_softmax_topk(x[:0, :experts], k, normalize, scale, dtype)[1].shape == (0, k)
