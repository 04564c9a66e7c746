"""Engine behaviour against runs that differ only in a knob: loops, prefix cache, KV budget."""

from __future__ import annotations

import pytest

from shoal import LLM, SamplingParams
from tests.conftest import random_prompts

GREEDY = SamplingParams(max_tokens=20)


def run(model: str, prompts, sampling=GREEDY, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 256)
    with LLM(model, **kw) as llm:
        outs = llm.generate(prompts, sampling)
        llm.check_integrity()
        stats = llm.stats()
    return outs, stats


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, [3, 9, 16, 33, 50, 71, 12, 5])


@pytest.fixture(scope="module")
def reference(tiny_model, prompts):
    outs, _ = run(tiny_model, prompts, overlap_scheduler=False, enable_prefix_caching=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_num_tokens", [2048, 16, 5])
def test_loops_and_chunking_identical(tiny_model, prompts, reference, overlap, max_num_tokens):
    outs, stats = run(tiny_model, prompts, overlap_scheduler=overlap, max_num_tokens=max_num_tokens)
    assert [o.token_ids for o in outs] == reference
    assert stats["forward_passes"] <= stats["iterations"]


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_under_tiny_kv_budget(tiny_model, prompts, reference, overlap):
    # 30 blocks of 4 tokens cannot hold all eight requests at once: some are preempted and
    # recomputed, and the tokens must not change.
    outs, stats = run(tiny_model, prompts, overlap_scheduler=overlap, num_kv_blocks=30)
    assert stats["preemptions"] > 0
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("overlap", [False, True])
def test_local_prefix_reuse(tiny_model, overlap):
    shared = random_prompts(512, [40], seed=7)[0]
    tails = random_prompts(512, [3, 6, 1], seed=8)
    prompts = [shared + t for t in tails]
    with LLM(tiny_model, block_size=4, num_kv_blocks=256, overlap_scheduler=overlap) as llm:
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
        again = llm.generate(prompts[:1], GREEDY)  # the whole prompt but its last block is cached
        llm.check_integrity()
        stats = llm.stats()
    baseline, _ = run(tiny_model, prompts, enable_prefix_caching=False)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in baseline]
    assert again[0].token_ids == baseline[0].token_ids
    assert first[0].num_local_prefix_tokens == 0
    assert all(o.num_local_prefix_tokens == 40 for o in rest)
    assert again[0].num_local_prefix_tokens == 40  # 43 tokens: never the last token's block
    assert stats["local_prefix_hit_tokens"] == 40 * 3


def test_seeded_sampling_reproducible_across_loops_and_batches(tiny_model, prompts):
    sampling = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=i)
                for i in range(len(prompts))]
    a, _ = run(tiny_model, prompts, sampling, overlap_scheduler=False)
    b, _ = run(tiny_model, prompts[::-1], sampling[::-1], overlap_scheduler=True, max_num_tokens=8)
    assert [o.token_ids for o in a] == [o.token_ids for o in b[::-1]]
    greedy, _ = run(tiny_model, prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_ends_request_and_is_included(tiny_model, prompts, reference, overlap):
    stop = reference[3][5]  # the 6th token the model generates for prompt 3
    sampling = SamplingParams(max_tokens=20, stop_token_ids=(stop,))
    outs, _ = run(tiny_model, prompts, sampling, overlap_scheduler=overlap)
    for out, ref in zip(outs, reference):
        if stop in ref:
            cut = ref.index(stop) + 1
            assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
        else:
            assert out.token_ids == ref and out.finish_reason == "length"


def test_oversize_prompt_fails_only_that_request(tiny_model, prompts, reference):
    too_long = random_prompts(512, [1025])[0]  # the tiny model's context is 1024
    with LLM(tiny_model, block_size=4, num_kv_blocks=256) as llm:
        outs = llm.generate([prompts[0], too_long, prompts[1]], GREEDY)
        llm.check_integrity()
    assert outs[1].finish_reason == "error"
    assert "1025 tokens" in outs[1].error and "1024" in outs[1].error
    assert outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids] == reference[:2]


def test_prompt_larger_than_kv_cache_fails_only_that_request(tiny_model, prompts, reference):
    with LLM(tiny_model, block_size=4, num_kv_blocks=10) as llm:
        outs = llm.generate([prompts[0], random_prompts(512, [60])[0]], GREEDY)
    assert outs[1].finish_reason == "error" and "KV blocks" in outs[1].error
    assert outs[0].token_ids == reference[0]


def test_generation_stops_at_context_length(tiny_model):
    prompt = random_prompts(512, [1020])[0]
    with LLM(tiny_model, block_size=16, num_kv_blocks=128) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=50))[0]
        llm.check_integrity()
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_stats_keys(tiny_model, prompts):
    _, stats = run(tiny_model, prompts[:2])
    for key in ("iterations", "forward_passes", "control_collectives", "pool_lookups",
                "pool_hit_blocks", "pool_miss_blocks", "connector_tokens_loaded", "bytes_loaded",
                "bytes_saved", "load_seconds", "save_seconds", "corrupt_blocks",
                "load_failures_recomputed", "deadline_expiries", "cancellations"):
        assert key in stats and key in stats["per_rank"][0]
    assert stats["generated_tokens"] == 40 and stats["iterations"] >= 20


def test_metrics_and_output_fields(tiny_model, prompts):
    outs, _ = run(tiny_model, prompts[:3])
    for o in outs:
        assert 0 < o.metrics.ttft_s <= o.metrics.e2e_s
        assert o.num_connector_tokens == 0 and o.error is None


def test_unknown_kwarg_is_type_error(tiny_model):
    with pytest.raises(TypeError):
        LLM(tiny_model, not_a_knob=3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=0), "block_size"), (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_num_tokens=-1), "max_num_tokens"), (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(kv_cache_gb=float("nan")), "kv_cache_gb"), (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"), (dict(dp_size=0), "dp_size"), (dict(tp_size=0), "tp_size"),
    (dict(enforce_eager="yes"), "enforce_eager"), (dict(overlap_scheduler=1), "overlap_scheduler"),
])
def test_invalid_config_names_the_field(tiny_model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model, **kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(temperature=float("inf")), "temperature"),
])
def test_invalid_sampling_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_is_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        LLM(str(tmp_path / "missing"))


def test_use_after_shutdown_is_an_error(tiny_model):
    llm = LLM(tiny_model, num_kv_blocks=16)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2, 3]])


def test_bring_up_computes_nothing_on_the_meta_device(tiny_model):
    # the model is laid out on the meta device, then given storage and loaded; an op run on
    # meta tensors there (a random init, to_empty's empty_like, the rotary table) pulls in
    # torch._dynamo and more: about 2 s of every rank process's start-up
    import subprocess
    import sys

    code = ("import sys; from shoal import LLM\n"
            "with LLM(sys.argv[1], block_size=4, num_kv_blocks=16) as llm:\n"
            "    ids = llm.generate([[1, 2, 3]])[0].token_ids\n"
            "print(len(ids), 'torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, tiny_model], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["16", "False"]


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
def test_a_bring_up_forward_after_a_cached_context_leaves_requests_alone(
        tiny_model, tiny_moe_models, family):
    """ModelRunner.time_prefill(n, context): the forward of a hit's last chunk, run at a GPU
    engine's bring-up (its first run's costs paid there), on the scratch block only: the
    requests after it get the tokens of an engine that never ran it."""
    model = tiny_model if family == "llama" else str(tiny_moe_models[family])
    prompts = random_prompts(512, [9, 33, 50])
    expected, _ = run(model, prompts)
    with LLM(model, block_size=4, num_kv_blocks=256) as llm:
        seconds, launch = llm.engine.runner.time_prefill(4, context=40)
        assert seconds > 0 and launch == 0.0  # (on a CPU the launch is the work)
        outs = llm.generate(prompts, GREEDY)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
