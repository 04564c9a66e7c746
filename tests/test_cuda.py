"""The CUDA path: the same equality with transformers on a GPU (skipped without one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal import LLM, SamplingParams
from tests.conftest import hf_greedy, random_prompts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# How far apart (in logprob, i.e. logit, units) the no-pool run's top two tokens may be for a
# bfloat16 run to take the second: a batch of another shape (a request joining late because
# its load finished later) rounds the projections differently, and a tiny random model has
# near ties. Measured on the H200: a top two 0.047 apart in bfloat16 (0.012 in float32)
# flipped when a late load changed the batch; float32 runs must be exact.
NEAR_TIE = 0.1


def reference(llm, prompts, sp):
    """The no-pool run's outputs, with the logprobs `assert_same_greedy` needs."""
    return llm.generate(prompts, dataclasses.replace(sp, logprobs=5))


def assert_same_greedy(expected, outs, exact=False):
    """Each request's greedy tokens are the no-pool run's; unless `exact`, a request may part
    from it where the no-pool run's top two were a near tie (at most one request may)."""
    parted = 0
    for ref, out in zip(expected, outs, strict=True):
        if out.token_ids == ref.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b)
        top = dict(ref.logprobs[i].top)
        assert not exact and out.token_ids[i] in top, (i, out.token_ids, ref.token_ids)
        assert top[ref.token_ids[i]] - top[out.token_ids[i]] <= NEAR_TIE, (i, top)
        parted += 1
    assert parted <= 1, parted


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_llama_on_cuda_matches_transformers(tiny_models, overlap):
    from transformers import AutoModelForCausalLM

    path = tiny_models["gqa_tied"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("cuda")
    prompts = random_prompts(512, [1, 5, 17, 40, 90])
    expected = [hf_greedy(ref, p, 24) for p in prompts]
    with LLM(str(path), device="cuda", dtype="float32", block_size=4, num_kv_blocks=128,
             max_num_tokens=16, overlap_scheduler=overlap) as llm:
        assert llm.engine.kv_cache.tensor.is_cuda
        outs = llm.generate(prompts, SamplingParams(max_tokens=24))
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected


def test_an_engine_process_on_cuda_equals_the_engine_in_process(tiny_models):
    """engine_process=True on a GPU (on the last card: its rank keeps the device it was
    given, not cuda:<rank>; with CUDA graphs): the tokens are the in-process engine's."""
    path = str(tiny_models["gqa_tied"])
    prompts = random_prompts(512, [1, 5, 17, 40, 90])
    kw = dict(device=f"cuda:{torch.cuda.device_count() - 1}", dtype="float32", block_size=4,
              num_kv_blocks=128)
    with LLM(path, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24))]
    with LLM(path, engine_process=True, **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=24))
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_moe_and_latent_attention_on_cuda_match_transformers(tiny_moe_models, name, tmp_path):
    """float32 on the GPU: routed and shared experts; MLA's absorbed decode in the Triton
    kernel (shoal/model/paged_mla.py) and its expanded prefill; then from the pool."""
    from transformers import AutoModelForCausalLM

    from shoal.connectors import ConnectorConfig

    path = tiny_moe_models[name]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to("cuda")
    prompts = random_prompts(512, [1, 5, 17, 40])
    expected = [hf_greedy(ref, p, 16) for p in prompts]
    # hits loaded whole: with no rate known, a hit this short is computed once its first
    # block is later than 5% of its compute time (microseconds here), as it once was
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path)}, compute_while_loading=False)
    for run in ("save", "load"):
        with LLM(str(path), device="cuda", dtype="float32", block_size=4, num_kv_blocks=128,
                 max_num_tokens=16, kv_connector=cfg) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
            llm.check_integrity()
        assert [o.token_ids for o in outs] == expected, run
        assert (sum(o.num_connector_tokens for o in outs) > 0) == (run == "load")


def test_smollm2_on_cuda_matches_transformers(smollm2_path, smollm2_hf):
    ref = smollm2_hf.to("cuda")
    try:
        with LLM(smollm2_path, device="cuda", dtype="float32", num_kv_blocks=256) as llm:
            tok = llm.tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
                       for q in ("What is the capital of France?", "Name three primary colors.")]
            prompts.append(tok.encode("The lighthouse keeper climbed the stairs. " * 20))
            outs = llm.generate(prompts, SamplingParams(max_tokens=20))
            llm.check_integrity()
        expected = [hf_greedy(ref, p, 20, eos_token_id=2) for p in prompts]
    finally:
        smollm2_hf.to("cpu")
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text


@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_fs_pool_round_trip_on_cuda(tiny_models, tmp_path, load_mode):
    """Saves copy GPU blocks to the host; loads read into pinned memory, then to the GPU."""
    from shoal.connectors import ConnectorConfig

    path = str(tiny_models["mha_untied"])
    prompts = random_prompts(512, [45, 30, 9])
    kw = dict(device="cuda", block_size=4, num_kv_blocks=128)
    with LLM(path, **kw) as llm:
        expected = reference(llm, prompts, SamplingParams(max_tokens=12))
    # whole loads: every matched block is loaded (a split depends on measured rates)
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path), "load_mode": load_mode},
                          compute_while_loading=False)
    runs = []
    for _ in range(2):  # producer, then a fresh consumer
        with LLM(path, kv_connector=cfg, **kw) as llm:
            runs.append(llm.generate(prompts, SamplingParams(max_tokens=12)))
            llm.check_integrity()
    assert_same_greedy(expected, runs[0])
    assert_same_greedy(expected, runs[1])
    assert [o.num_connector_tokens for o in runs[1]] == [44, 28, 8]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_late_and_stalled_transfers_on_cuda(tiny_models, tmp_path, dtype):
    """The failure policy's paths on GPU blocks: late loads and saves (pinned staging) give
    the no-pool tokens; a load stalled past its deadline is aborted, that request errs.
    A late load makes its request join a batch of another shape: float32 tokens are exact,
    bfloat16 ones may take a near tie the other way."""
    from shoal.connectors import ConnectorConfig

    path = str(tiny_models["mha_untied"])
    prompts = random_prompts(512, [45, 30])
    kw = dict(device="cuda", dtype=dtype, block_size=4, num_kv_blocks=128)
    sp = SamplingParams(max_tokens=8)
    with LLM(path, **kw) as llm:
        expected = reference(llm, prompts, sp)

    def cfg(fault, timeout=600.0):
        return ConnectorConfig(module="tests.fault_connector", scheduler_class="FaultScheduler",
                               worker_class="FaultWorker",
                               options={"root": str(tmp_path), "fault": fault},
                               transfer_timeout_sec=timeout, control_grace_sec=0.5)
    for _ in ("producer", "consumer"):
        with LLM(path, kv_connector=cfg({"load_polls": 3, "save_polls": 3}), **kw) as llm:
            assert_same_greedy(expected, llm.generate(prompts, sp), exact=dtype == "float32")
            llm.check_integrity()
    with LLM(path, kv_connector=cfg({"load_polls": -1}, timeout=1.0), **kw) as llm:
        outs = llm.generate(prompts, sp)
        llm.check_integrity()
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("aborted" in o.error for o in outs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("eager", [True, False])
def test_half_precision_on_cuda_matches_transformers(tiny_models, dtype, eager):
    """Paged kernels, and (eager=False) decode steps replayed from CUDA graphs."""
    from tests.test_half import DTYPES, MAX_TOKENS, assert_greedy_matches, hf_greedy_logits, hf_model

    path = tiny_models["gqa_tied"]
    prompts = random_prompts(512, [1, 5, 17, 40, 90], seed=21)
    ref = hf_model(path, DTYPES[dtype]).to("cuda")
    with LLM(str(path), device="cuda", dtype=dtype, block_size=16, num_kv_blocks=128,
             max_num_tokens=32, enforce_eager=eager) as llm:
        assert llm.engine.runner.is_paged and (llm.engine.runner.graphs is None) == eager
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        llm.check_integrity()
    exact = 0
    for prompt, out in zip(prompts, outs):
        tokens, logits = hf_greedy_logits(ref, prompt, MAX_TOKENS)
        exact += assert_greedy_matches(ref, prompt, out.token_ids, tokens, logits, tol=0.02)
    assert exact >= len(prompts) - 1


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_graphs_give_the_eager_tokens(tiny_models, overlap, monkeypatch):
    """Ragged batches of many sizes (graphs padded to the ladder), prefix hits, preemption.
    No prefill graphs here: their projections run on rows padded to the graph's length,
    rounded as another shape (test_prefill_graphs_give_the_eager_tokens)."""
    from shoal.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "PREFILL_LADDER", ())
    path = str(tiny_models["mha_untied"])
    shared = random_prompts(512, [33], seed=4)[0]
    prompts = [shared + p for p in random_prompts(512, [1, 7, 20, 2, 60, 9, 3], seed=8)]
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 5, 17, 40, 2, 25, 33)]
    runs = {}
    for eager in (True, False):
        with LLM(path, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=40,
                 max_batch_size=6, overlap_scheduler=overlap, enforce_eager=eager) as llm:
            runs[eager] = [o.token_ids for o in llm.generate(prompts, sp)]
            if not eager:
                graphs = llm.engine.runner.graphs
                assert graphs.num_replays > 0 and graphs.num_prefill_replays == 0
            llm.check_integrity()
    assert runs[False] == runs[True]


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_graphs_give_the_eager_tokens(tiny_models, overlap, monkeypatch):
    """A step of one request's short chunk replays a prefill graph: a prompt alone, the
    rest of one after a prefix hit, the chunks of a long one (40 tokens a step, so they
    start inside 16-token blocks): the eager run's tokens, but for a near tie (the graph's
    projections run on rows padded to its length, rounded as another shape)."""
    from shoal.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "PREFILL_LADDER", (16, 32, 40))
    path = str(tiny_models["gqa_tied"])
    shared = random_prompts(512, [40], seed=5)[0]
    prompts = ([shared + p for p in random_prompts(512, [2, 9, 31, 70], seed=9)]
               + random_prompts(512, [200], seed=3))
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=128,
              max_num_tokens=40, overlap_scheduler=overlap)
    runs = {}
    for eager in (True, False):
        with LLM(path, enforce_eager=eager, **kw) as llm:
            runs[eager] = [(reference(llm, [p], sp) if eager else llm.generate([p], sp))[0]
                           for p in prompts]
            if not eager:  # each prompt's chunks, and no decode step prefilled
                assert llm.engine.runner.graphs.num_prefill_replays >= len(prompts) + 3
            llm.check_integrity()
    assert [o.num_local_prefix_tokens > 0 for o in runs[False]] == [False] + [True] * 3 + [False]
    assert_same_greedy(runs[True], runs[False])


def test_decode_graphs_with_a_pool_on_cuda(tiny_models, tmp_path):
    """Layer hooks around a replayed step: the pool round trip gives the no-pool tokens."""
    path = str(tiny_models["gqa_tied"])
    prompts = random_prompts(512, [45, 30, 9], seed=2)
    kw = dict(device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=128)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(path, **kw) as llm:
        expected = reference(llm, prompts, sp)
    from shoal.connectors import ConnectorConfig

    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path)}, compute_while_loading=False)
    for _ in range(2):
        with LLM(path, kv_connector=cfg, **kw) as llm:
            outs = llm.generate(prompts, sp)
            assert llm.engine.runner.graphs.num_replays > 0
            llm.check_integrity()
        assert_same_greedy(expected, outs)
    assert [o.num_connector_tokens for o in outs] == [32, 16, 0]


def _bf16_pool_workload(tiny_models, seed: int):
    """Three prompts of 68 full 4-token blocks in all on a bfloat16 GQA model: (path,
    prompts, engine kwargs, sampling, the no-pool outputs, a block's bytes)."""
    path = str(tiny_models["gqa_tied"])
    prompts = random_prompts(512, [85, 70, 121], seed=seed)
    kw = dict(device="cuda", dtype="bfloat16", block_size=4, num_kv_blocks=256,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(path, **kw) as llm:
        return (path, prompts, kw, sp, reference(llm, prompts, sp),
                llm.engine.kv_cache.layout.block_nbytes)


def _run_checked(path, cfg, kw, prompts, sp, check=lambda llm: True):
    """A fresh engine on the pool: its outputs and stats, check(llm) true before the run,
    every block accounted for after it."""
    with LLM(path, kv_connector=cfg, **kw) as llm:
        assert check(llm)
        outs = llm.generate(prompts, sp)
        llm.check_integrity()
        return outs, llm.stats()


def _flip(path, offset: int, mask: int) -> bytes:
    """XOR one byte of a file with `mask`; the file's new bytes."""
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("tier", ["roomy", "small"])
def test_pool_through_the_host_tier_on_cuda(tiny_models, tmp_path, tier):
    """bfloat16 KV through pinned pages: a fresh engine reads the files, a repeat comes from
    the tier (roomy: all of it; small: one-block pages, the staging minimum of four per
    I/O thread and four more, for 68 blocks); a flipped byte in one file is a miss
    recomputed. Every run gives the no-pool tokens."""
    from shoal.connectors import ConnectorConfig
    from shoal.connectors.fs import format as pf

    path, prompts, kw, sp, expected, block_nbytes = _bf16_pool_workload(tiny_models, seed=5)
    pool = tmp_path / "pool"
    tier_bytes = 1 << 26 if tier == "roomy" else block_nbytes
    cfg = ConnectorConfig(name="fs", options={"root": str(pool), "host_tier_bytes": tier_bytes},
                          compute_while_loading=False)
    with LLM(path, kv_connector=cfg, **kw) as llm:  # computes, saves through pages
        assert_same_greedy(expected, llm.generate(prompts, sp))
        worker = llm.engine.transfers.calls.worker
        slots = worker.tier.num_pages * worker.tier.blocks_per_page
        assert slots >= (68 if tier == "roomy" else 4 * (worker._num_threads + 1))
        assert tier == "roomy" or slots < 68  # (small: the blocks do not all fit)
    with LLM(path, kv_connector=cfg, **kw) as llm:
        first = llm.generate(prompts, sp)  # from the files
        again = llm.generate(prompts, sp)  # the tier (roomy), or mostly the files again
        llm.check_integrity()
        stats = llm.stats()
    assert_same_greedy(expected, first)
    assert_same_greedy(expected, again)
    assert [o.num_connector_tokens for o in again] == [84, 68, 120]
    assert stats["blocks_loaded"] == 2 * 68
    if tier == "roomy":
        assert stats["host_tier_hit_blocks"] == 68
    else:
        assert stats["host_tier_hit_blocks"] <= 36
    _flip(next(iter(pf.iter_block_files(pool))), pf.HEADER_SIZE + 10, 0x01)
    outs, stats = _run_checked(path, cfg, kw, prompts, sp)
    assert_same_greedy(expected, outs)
    assert stats["corrupt_blocks"] == 1 and stats["load_failures_recomputed"] == 1


def test_loads_verified_on_the_gpu(tiny_models, tmp_path):
    """Files read without the CPU's hash and verified on the GPU after the copy: a fresh
    engine gives the no-pool tokens; a flipped payload byte in two files is caught there
    (quarantined, recomputed and saved again whole, same tokens); a request cancelled
    while its load may be in flight leaves every block accounted for (check_integrity)."""
    from shoal.connectors import ConnectorConfig
    from shoal.connectors.fs import format as pf

    path, prompts, kw, sp, expected, _ = _bf16_pool_workload(tiny_models, seed=7)
    pool = tmp_path / "pool"
    cfg = ConnectorConfig(name="fs", options={"root": str(pool)}, compute_while_loading=False)
    with LLM(path, kv_connector=cfg, **kw) as llm:
        assert_same_greedy(expected, llm.generate(prompts, sp))
    outs, stats = _run_checked(path, cfg, kw, prompts, sp,
                               lambda llm: llm.engine.transfers.calls.worker._mover.verifies)
    assert_same_greedy(expected, outs)
    assert [o.num_connector_tokens for o in outs] == [84, 68, 120]
    assert stats["blocks_loaded"] == 68 and stats["corrupt_blocks"] == 0
    victims = sorted(pf.iter_block_files(pool))[:2]
    corrupted = [_flip(v, -3, 0x10) for v in victims]
    outs, stats = _run_checked(path, cfg, kw, prompts, sp)
    assert_same_greedy(expected, outs)
    assert stats["corrupt_blocks"] == 2 and stats["load_failures_recomputed"] >= 1
    assert len(list((pool / "quarantine").iterdir())) == 2
    # set aside, recomputed and saved again whole
    assert [v.read_bytes() != c for v, c in zip(victims, corrupted)] == [True, True]
    with LLM(path, kv_connector=cfg, **kw) as llm:  # cancel while loads are in flight
        handles = [llm.submit(p, sp) for p in prompts]
        handles[1].cancel()
        outs = [h.result() for h in handles]
        llm.check_integrity()
    assert outs[1].finish_reason == "cancelled" or outs[1].token_ids == expected[1].token_ids
    assert_same_greedy([expected[0], expected[2]], [outs[0], outs[2]])


@pytest.mark.parametrize("source", ["files", "tier"])
def test_compute_while_loading_on_cuda(tiny_models, tmp_path, source):
    """The front computed on the GPU while the back loads through pinned pages (rates pinned
    so that every hit is split): the no-pool tokens, each matched token computed or loaded
    once, every block accounted for; from the files, then (tier) from the host tier."""
    from shoal.connectors import ConnectorConfig
    from shoal.engine.load_split import MIN_SPLIT_GAIN

    path, prompts, kw, sp, expected, block_nbytes = _bf16_pool_workload(tiny_models, seed=9)
    pool = tmp_path / "pool"
    with LLM(path, kv_pool=str(pool), **kw) as llm:  # computes and saves
        assert_same_greedy(expected, llm.generate(prompts, sp))
    # reads paced at 2 ms a block: the loads take as long as the pinned rates say
    cfg = ConnectorConfig(name="fs", options={"root": str(pool),
                                              "max_read_gbps": block_nbytes / 2e-3 / 1e9})
    with LLM(path, kv_connector=cfg, **kw) as llm:
        planner = llm.engine.transfers.planner
        assert planner.min_gain == MIN_SPLIT_GAIN  # a GPU's (set by the device, not timed)
        planner.prefill_tps.value, planner.load_tps.value = 2000.0, 2000.0
        planner.load_latency_s.value = planner.prefill_overhead_s = 0.0
        planner.prefill_launch_s = 0.0
        planner.observe_prefill = planner.observe_load = planner.observe_front = (
            lambda *a, **k: None)
        planner.front_slowdown.value = planner.load_slowdown.value = None
        if source == "tier":
            llm.generate(prompts, sp)
        outs = llm.generate(prompts, sp)
        llm.check_integrity()
        stats = llm.stats()
    assert_same_greedy(expected, outs)
    for out in outs:
        hit = out.pool_hit
        assert hit.decision == "split" and hit.num_front_tokens > 0
        assert hit.num_front_tokens + hit.num_loaded_tokens == hit.num_matched_tokens
    assert stats["pool_hits_split"] == (6 if source == "tier" else 3)


def test_bench_pool_io_on_cuda():
    """`shoal bench pool-io --device cuda`: GPU blocks through the host tier (the bench
    asserts the loaded bytes, from files and from the tier, equal the saved ones)."""
    import json
    import subprocess
    import sys

    from shoal.connectors.fs.connector import default_read_processes
    from shoal.connectors.store.base import default_io_threads

    r = subprocess.run([sys.executable, "-m", "shoal", "bench", "pool-io", "--device", "cuda",
                        "--num-blocks", "32", "--rounds", "1"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    # the connector's default threads on a GPU (fewer where processes read the files)
    threads = default_io_threads(True, bool(default_read_processes("cuda")))
    assert result["device"] == "cuda" and result["threads"] == threads
    assert result["load_tier_gbps"] > 0 and result["step_ms_saving"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("widths", [(64, 64), (192, 128)])  # (q/k, v): dense, MLA expanded
@pytest.mark.parametrize("n,ctx", [(300, 300), (5, 300), (64, 1000)])
def test_causal_attention_on_cuda_matches_the_masked_reference(dtype, widths, n, ctx,
                                                                monkeypatch):
    """The GPU's causal attention against the explicit mask in float64: in half precision
    through flash (a tail with flash's own end-aligned window, values narrower than the keys
    padded), in float32 through the masked kernels."""
    from shoal.model import attention_backend as ab
    flash_tails = []
    real = ab._flash_causal
    monkeypatch.setattr(ab, "_flash_causal", lambda *a: (flash_tails.append(1), real(*a))[1])
    causal_attention = ab.causal_attention
    d, dv = widths
    gen = torch.Generator().manual_seed(n + ctx + d)
    q, keys, values = (torch.randn(*shape, generator=gen)
                       for shape in ((n, 4, d), (4, ctx, d), (4, ctx, dv)))
    out = causal_attention(*(t.to("cuda", dtype) for t in (q, keys, values)), scale=0.1)
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]  # [n, ctx]
    logits = torch.einsum("nhd,hcd->hnc", q.double(), keys.double()) * 0.1
    ref = torch.einsum("hnc,hcv->nhv", logits.masked_fill(~visible, float("-inf")).softmax(-1),
                       values.double())
    assert out.shape == (n, 4, dv)
    flash = dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    assert len(flash_tails) == (flash and n < ctx)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
