"""The Triton paged-attention kernels against a plain reference, on random inputs: ragged
lengths, GQA, block sizes 16 and 32, chunked prefill. On CPU through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU); compiled on a GPU. And the two
attention backends on the same inputs: the torch backend is the kernels' reference."""

from __future__ import annotations

import pytest
import torch

pa = pytest.importorskip("shoal.model.paged_attention")
if not pa.HAS_TRITON:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, layers=2):
    """A block-major cache like KVCache's, and layer 1's (k, v) views (strided)."""
    t = torch.randn(num_blocks, layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype,
                    device=DEVICE)
    return t[:, 1, 0], t[:, 1, 1]


def tables(lengths, block_size, num_blocks, g):
    """A random, non-overlapping block table row per request, padded with -1 then 0."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    rows, width = [], max(-(-n // block_size) for n in lengths)
    for n in lengths:
        need = -(-n // block_size)
        rows.append([perm.pop() for _ in range(need)] + [0] * (width - need))
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def reference(q_rows, k_cache, v_cache, table_row, ctx):
    """q_rows [n, Hq, D] at positions [ctx - n, ctx), causal over [0, ctx), in float64."""
    n, hq, d = q_rows.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    blocks = table_row[: -(-ctx // bs)].long()
    k = k_cache[blocks].reshape(-1, hkv, d)[:ctx].double()
    v = v_cache[blocks].reshape(-1, hkv, d)[:ctx].double()
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("nhd,khd->hnk", q_rows.double(), k) * d ** -0.5
    pos = torch.arange(ctx - n, ctx, device=q_rows.device)[:, None]
    s = s.masked_fill(torch.arange(ctx, device=q_rows.device)[None, :] > pos, float("-inf"))
    return torch.einsum("hnk,khd->nhd", s.softmax(-1), v)


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (8, 1)])
def test_decode_matches_reference(dtype, block_size, heads):
    g = torch.Generator().manual_seed(block_size * 10 + heads[0] + heads[1])
    hq, hkv = heads
    d = 64 if DEVICE == "cuda" else 32
    lengths = [1, 5, block_size, block_size + 1, 3 * block_size + 7, 100]
    k_cache, v_cache = make_cache(64, block_size, hkv, d, dtype)
    table = tables(lengths, block_size, 64, g)
    q = torch.randn(len(lengths), hq, d, dtype=dtype, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))  # every element must be written
    pa.paged_decode(q, k_cache, v_cache, table, lens, out=out)
    for b, n in enumerate(lengths):
        ref = reference(q[b:b + 1], k_cache, v_cache, table[b], n)[0]
        err = (out[b].double() - ref).norm() / ref.norm()
        assert err < TOL[dtype], (b, n, float(err))


def test_decode_padding_row_is_zero():
    k_cache, v_cache = make_cache(8, 16, 2, 32, torch.float32)
    q = torch.randn(2, 4, 32, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    out = pa.paged_decode(q, k_cache, v_cache, table,
                          torch.tensor([3, 0], dtype=torch.int32, device=DEVICE))
    assert torch.isfinite(out).all() and out[1].abs().max() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 3)])
def test_prefill_matches_reference(dtype, block_size, heads):
    """Ragged chunks: a whole prompt, chunks continuing cached context, a one-token chunk."""
    check_prefill(dtype, block_size, heads, [(37, 37), (20, 90), (1, 17), (70, 70), (16, 48)])


def test_prefill_with_a_head_dim_no_power_of_two():
    """A head dim the kernel pads (48 in tiles of 64): the padding lanes are masked in the
    tiles along the diagonal and in those every row sees whole (keys before a chunk's first
    position, here up to 640), in one part and in three."""
    for parts in (1, 3):
        check_prefill(DTYPES[-1], 16, (4, 2), [(100, 700), (70, 70), (5, 200)], parts=parts,
                      num_blocks=96, d=48)


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("parts", [2, 4, 16])
def test_prefill_over_a_split_context_matches_reference(block_size, parts):
    """Contexts walked in parts side by side, then folded: short chunks after long cached
    contexts (a prompt's rest after a pool hit), a chunk of two query tiles whose first rows
    see no key of the last parts, parts with no keys at all, a whole short prompt."""
    check_prefill(DTYPES[-1], block_size, (4, 2), [(3, 600), (100, 700), (70, 70), (1, 17)],
                  parts=parts, num_blocks=96)


def check_prefill(dtype, block_size, heads, chunks, parts=None, num_blocks=64, d=None):
    """paged_prefill of `chunks` (new tokens, context after) against the reference; `d`
    the head dim (None: 64 on a GPU, 32 on a CPU)."""
    g = torch.Generator().manual_seed(block_size + 7 * heads[0] + len(chunks))
    hq, hkv = heads
    d = d or (64 if DEVICE == "cuda" else 32)
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, dtype)
    table = tables([c for _, c in chunks], block_size, num_blocks, g)
    lens = [n for n, _ in chunks]
    starts = [sum(lens[:i]) + 3 for i in range(len(lens))]  # rows 0-2 belong to nobody
    total = starts[-1] + lens[-1] + 2
    q = torch.randn(total, hq, d, dtype=dtype, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    pa.paged_prefill(q, k_cache, v_cache, table, as_t(starts), as_t(lens),
                     as_t([c for _, c in chunks]), max(lens), out=out, parts=parts)
    for s, (n, ctx) in enumerate(chunks):
        rows = slice(starts[s], starts[s] + n)
        ref = reference(q[rows], k_cache, v_cache, table[s], ctx)
        err = (out[rows].double() - ref).norm() / ref.norm()
        assert err < TOL[dtype], (s, n, ctx, float(err))
    assert torch.isnan(out[:3]).all()  # rows of no request untouched


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="forces the kernel path on CPU tensors (the interpreter); "
                                     "on a GPU tests/test_cuda.py runs it for real")


@pytest.fixture(params=["llama", "deepseek_v2", "qwen3_moe"])
def kernel_model(request) -> str:
    """A dense GQA model; one with latent attention (its decode kernel and its fused rope,
    norm and cache write) and experts (the fused MoE) under group-limited routing; and one
    with experts under greedy routing (the router's kernel): what the Triton backend runs
    on a GPU."""
    if request.param == "llama":
        return request.getfixturevalue("tiny_model")
    return str(request.getfixturevalue("tiny_moe_models")[request.param])


@CPU_ONLY
@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.extended), True])
def test_engine_on_the_paged_path_equals_the_reference_path(kernel_model, overlap):
    """The runner's kernel path (packed inputs, paged kernels: what CUDA runs), forced here
    on CPU through the interpreter, gives the reference path's tokens: prefill chunks,
    prefix hits, decodes."""
    from shoal import LLM, SamplingParams
    from shoal.model.attention_backend import TritonBackend
    from tests.conftest import random_prompts
    tiny_model = kernel_model

    shared = random_prompts(512, [24], seed=5)[0]
    prompts = [shared + p for p in random_prompts(512, [3, 17, 40], seed=6)] + [[7]]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=128, max_num_tokens=32, overlap_scheduler=overlap)
    with LLM(tiny_model, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, sp)]
    with LLM(tiny_model, **kw) as llm:
        runner = llm.engine.runner
        runner.model.use_backend(TritonBackend())
        outs = llm.generate(prompts, sp)
        again = llm.generate(prompts[:2], sp)  # local prefix hits: chunks continuing context
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert [o.token_ids for o in again] == expected[:2]
    assert again[0].num_local_prefix_tokens > 0


@CPU_ONLY
def test_graph_inputs_give_the_reference_tokens(kernel_model, monkeypatch):
    """What a replayed graph reads, run eagerly on CPU through the kernels: the reference
    path's tokens. Decode graphs: their padded batch (ladder sizes, scratch-block rows with
    no context), their table gathered from the rows kept across steps. Prefill graphs: one
    request's chunk padded to the ladder (16 and 30 tokens here), the padding
    rows a request with no context, the context in a fixed number of parts (3 here; a CPU
    would take 1), as after a prefix hit and for a prompt alone, in chunks that start
    inside a block; for MLA the 16-token graph only (its absorbed chunks). The capture
    itself needs a GPU (tests/test_cuda.py)."""
    from shoal import LLM, SamplingParams
    from shoal.engine import cuda_graphs
    from shoal.model.attention_backend import TritonBackend
    from tests.conftest import random_prompts

    class EagerGraphs(cuda_graphs.StepGraphs):
        def __init__(self, model, kv_cache, max_batch_size, max_num_tokens, table_rows):
            self.model, self.kv_cache, self.table_rows = model, kv_cache, table_rows
            self.width, self.block_size = table_rows.width, kv_cache.layout.block_size
            self.max_size = max_batch_size
            self._build_inputs(torch.device("cpu"), max_num_tokens)

        def replay(self, g, batch, runner, layer_hooks=None):
            self.prepare(g, batch, runner)
            self.num_replays += 1
            self.num_prefill_replays += not g.decode
            return self._forward(g)[:sum(c.is_sampling for c in batch.chunks)]

    monkeypatch.setattr(cuda_graphs, "prefill_parts", lambda device, programs, context: 3)
    monkeypatch.setattr(cuda_graphs, "PREFILL_LADDER", (16, 30))
    tiny_model = kernel_model
    shared = random_prompts(512, [21], seed=16)[0]
    prompts = [shared + p for p in random_prompts(512, [3, 17, 9, 30, 1], seed=15)]
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 3, 9, 6, 14)]
    kw = dict(block_size=4, num_kv_blocks=128, max_batch_size=5, max_num_tokens=30)
    alone = random_prompts(512, [70], seed=17)[0]  # chunks of 30, 30, 10: from 30, 60

    def run(llm):  # a batch, then each prompt alone (a prefix hit: one chunk in a step)
        # and a new one alone
        few = SamplingParams(max_tokens=3, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, sp)] + [
            o.token_ids for p in prompts + [alone] for o in llm.generate([p], few)]

    with LLM(tiny_model, **kw) as llm:
        expected = run(llm)
    with LLM(tiny_model, **kw) as llm:
        runner = llm.engine.runner
        runner.model.use_backend(TritonBackend())
        runner.graphs = EagerGraphs(runner.model, runner.kv_cache, 5, 30, runner.table_rows)
        outs = run(llm)
        assert runner.graphs.num_replays > runner.graphs.num_prefill_replays
        assert runner.graphs.num_prefill_replays > 0
        assert sorted(t for kind, t in runner.graphs.graphs if kind == "prefill") == (
            [16] if runner.model.cfg.is_mla else [16, 30])  # (MLA: chunks it absorbs)
        runner.graphs.table_rows.check_integrity()
        assert not runner.graphs.table_rows._rows  # every finished request gave its row back
        llm.check_integrity()
    assert outs == expected


@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_warm_up_touches_only_the_scratch_block(heads):
    """Start-up compilation writes the scratch block (the last one) and nothing else."""
    hq, hkv = heads
    k_cache, v_cache = make_cache(5, 16, hkv, 32, torch.float32)
    before_k, before_v = k_cache[:4].clone(), v_cache[:4].clone()
    pa.warm_up(torch.empty(1, hq, 32, device=DEVICE), k_cache, v_cache, scratch_block=4)
    assert torch.equal(k_cache[:4], before_k) and torch.equal(v_cache[:4], before_v)
    assert k_cache[4, :2].abs().max() == 0  # the warm-up wrote zeros into the scratch slots


def layout(chunks, block_size, num_blocks, g):
    """AttentionMetadata of one step whose requests are `chunks` (new tokens, context after),
    rows in that order, over random non-overlapping blocks: what the runner builds."""
    from shoal.model.llama import AttentionMetadata, PagedInputs
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    table = tables([c for _, c in chunks], block_size, num_blocks, g)
    lens, ctxs = [n for n, _ in chunks], [c for _, c in chunks]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    slots = [(int(table[s, p // block_size]), p % block_size)
             for s, (n, c) in enumerate(chunks) for p in range(c - n, c)]
    paged = PagedInputs(table, as_t(starts), as_t(lens), as_t(ctxs), max(lens),
                        (starts, lens, ctxs))
    return AttentionMetadata(as_t([b for b, _ in slots]), as_t([o for _, o in slots]), paged)


# one step each: decodes only (a ragged batch); chunks only; decodes and chunks mixed; and
# the mixed batch after requests left and others joined (other rows, other blocks)
STEPS = {"decode": [(1, 1), (1, 17), (1, 33), (1, 100)],
         "prefill": [(37, 37), (20, 90), (16, 48)],
         "mixed": [(1, 40), (25, 25), (1, 3), (12, 60), (1, 16)],
         "left_and_joined": [(1, 41), (1, 61), (9, 9), (1, 4)]}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
def test_the_two_backends_agree_on_the_same_inputs(step, heads):
    """The torch backend is the kernels' reference: the same AttentionMetadata, the same
    cache, the same stored KV and the same attention output."""
    from shoal.model.attention_backend import TorchBackend, TritonBackend
    g = torch.Generator().manual_seed(len(step) * 31 + heads[0])
    hq, hkv = heads
    d, bs = (64 if DEVICE == "cuda" else 32), 16
    meta = layout(STEPS[step], bs, 64, g)
    num_rows = sum(n for n, _ in STEPS[step])
    q = torch.randn(num_rows, hq, d, device=DEVICE)
    k, v = torch.randn(num_rows, hkv, d, device=DEVICE), torch.randn(num_rows, hkv, d, device=DEVICE)
    outs, caches = [], []
    for backend in (TorchBackend(), TritonBackend()):
        torch.manual_seed(5)  # the same cache for both
        k_cache, v_cache = make_cache(64, bs, hkv, d, torch.float32)
        backend.store(k, v, k_cache, v_cache, meta)
        outs.append(backend.attend(q, meta, k_cache, v_cache))
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    err = (outs[0].double() - outs[1].double()).norm() / outs[0].double().norm()
    assert err < TOL[torch.float32], float(err)


def test_a_context_is_split_only_where_the_programs_leave_the_gpu_idle(monkeypatch):
    """prefill_parts: about PROGRAMS_PER_SM times the SMs' worth of programs, parts of at
    least PART_KEYS keys, at most MAX_PARTS; one part on a CPU."""
    monkeypatch.setattr(pa, "_sm_count", lambda index: 132)  # an H100's
    gpu = torch.device("cuda", 0)
    assert pa.prefill_parts(gpu, 32, 8192) == 16  # 64 tokens of Llama-8B over 8k: 32 programs
    assert pa.prefill_parts(gpu, 128, 8192) == 5  # 256 tokens: 4 tiles x 32 heads
    assert pa.prefill_parts(gpu, 32, 600) == 1  # too short a context to cut
    assert pa.prefill_parts(gpu, 2, 1 << 20) == pa.MAX_PARTS
    assert pa.prefill_parts(gpu, 4096, 8192) == 1  # a long chunk fills the GPU already
    assert pa.prefill_parts(torch.device("cpu"), 32, 8192) == 1
