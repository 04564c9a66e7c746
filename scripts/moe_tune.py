"""The fused MoE's tile sizes against its floor, on the lent GPU (bf16, random routing).

    PYTHONPATH=$PWD python3 scripts/moe_tune.py [TOKENS ...]   (default: 64 256 4096)

For each real expert shape and batch (decode batches of 64 and 256 tokens, a prefill chunk
of 4096), every (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) in the sweep is captured in a CUDA graph (as the decode step runs it) and replayed; the time
is set against the floor: the weights of the experts the batch routes to, read once at the
bandwidth of a large device copy (and, for the chunk, its FLOPs at 750 TFLOP/s). Prints
the best configs per case and the one `pick_tiles` chooses, and the time of the routing
layout alone (the launches before the two GEMMs).
"""

from __future__ import annotations

import itertools
import sys

import torch

from shoal.model.fused_moe import TILES, _sort_by_expert, fused_experts, pick_tiles

SHAPES = {  # name: (hidden, moe intermediate, experts, top-k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
}
SWEEP = {16: [(16, n, k, 4, s) for n, k, s in itertools.product((64, 128), (64, 128), (3, 4))],
         64: [(64, n, 64, w, 3) for n, w in itertools.product((64, 128), (4, 8))],
         128: [(128, n, k, 8, 3) for n, k in itertools.product((64, 128), (32, 64))]}
BATCHES = {64: (16,), 256: (16, 64), 4096: (64, 128)}  # tokens: the tile heights tried


def _bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def _replay_ms(fn, reps: int = 30) -> float:
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(batches: dict[int, tuple[int, ...]]) -> None:
    bw = _bandwidth()
    print(f"device copy bandwidth {bw / 1e9:.0f} GB/s; default tiles {TILES}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (hidden, inter, experts, k) in SHAPES.items():
        gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16,
                              generator=g) * 0.02
        down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16,
                           generator=g) * 0.02
        for tokens, heights in batches.items():
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
            chosen = torch.rand(tokens, experts, device="cuda", generator=g).argsort(1)[:, :k]
            weights = torch.rand(tokens, k, device="cuda", generator=g).to(torch.bfloat16)
            touched = chosen.unique().numel()
            floor_ms = max(1e3 * touched * 3 * hidden * inter * 2 / bw,
                           1e3 * 2 * tokens * k * 3 * hidden * inter / 750e12)
            rows = []
            chosen_tiles = pick_tiles(chosen.numel(), experts)
            sweep = [t for h in heights for t in SWEEP[h]]
            for tiles in sweep + ([chosen_tiles] if chosen_tiles not in sweep else []):
                try:
                    ms = _replay_ms(lambda: fused_experts(x, gate_up, down, weights, chosen, 0,
                                                          tiles))
                except Exception as e:  # a config that does not compile (shared memory)
                    print(f"  {tiles}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                rows.append((ms, tiles))
            rows.sort()
            layout_ms = _replay_ms(lambda: _sort_by_expert(chosen, 0, experts, chosen_tiles[0]))
            print(f"{name} T={tokens}: {touched}/{experts} experts, floor {floor_ms:.3f} ms; "
                  f"the rows' layout alone {layout_ms * 1e3:.1f} us")
            for ms, tiles in rows[:5] + [r for r in rows if r[1] == chosen_tiles]:
                print(f"  {str(tiles):<20} {ms:7.3f} ms  x{ms / floor_ms:5.2f} floor")


if __name__ == "__main__":
    main({int(t): BATCHES[int(t)] for t in sys.argv[1:]} or BATCHES)
