"""The ConnectorManager against a connector whose transfers finish late (SPEC 3 invariants)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.request import NewRequest, RequestStatus
from tests import late_connector as late
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=8)


def late_config(delay=3, **kw) -> ConnectorConfig:
    return ConnectorConfig(module="tests.late_connector", scheduler_class="LateScheduler",
                           worker_class="LateWorker", options={"delay_polls": delay}, **kw)


@pytest.fixture
def prompts():
    shared = random_prompts(512, [24], seed=3)[0]
    return [shared + t for t in random_prompts(512, [5, 2, 9, 1, 7, 3], seed=4)]


@pytest.fixture
def baseline(tiny_model, prompts):
    with LLM(tiny_model, block_size=4, num_kv_blocks=256) as llm:
        return [o.token_ids for o in llm.generate(prompts, SP)]


def drive(llm: LLM, prompts, sampling=SP) -> dict[str, list]:
    """Step the engine by hand, checking invariants 1, 2 and 5 after every step."""
    engine = llm.engine
    runner = engine.runner
    real_execute = runner.execute

    def checked_execute(batch, token_counts, hooks=None, **kw):
        for chunk in batch.chunks:  # invariant 2: a loading request is never in a batch
            assert chunk.request.status != RequestStatus.WAITING_FOR_LOAD, chunk.request.request_id
            assert not engine.transfers.is_loading(chunk.request.request_id)
        return real_execute(batch, token_counts, hooks, **kw)

    runner.execute = checked_execute
    rids = [engine.add(NewRequest(p, sampling)) for p in prompts]
    reqs = [engine.live_requests()[rid] for rid in rids]
    ended = Counter()
    outputs, loaded = {}, {}
    steps = 0
    while engine.has_work:
        for out in engine.step().finished:
            ended[out.request_id] += 1
            outputs[out.request_id] = list(out.token_ids)
            loaded[out.request_id] = out.num_connector_tokens
        steps += 1
        assert steps < 2000, "engine did not finish"
        engine.check_integrity()
        pool = engine.kv_manager.pool
        for rid, blocks in late.PENDING.items():  # invariant 1: pending blocks stay held
            for b in blocks:
                assert pool.blocks[b].ref_count > 0 and not pool.is_free(b), (rid, b)
    runner.execute = real_execute
    assert all(ended[r.request_id] == 1 for r in reqs), ended  # invariant 5
    return {"tokens": [outputs[r.request_id] for r in reqs],
            "loaded": [loaded[r.request_id] for r in reqs]}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("delay", [1, 4])
def test_late_transfers_keep_invariants_and_outputs(tiny_model, prompts, baseline, overlap, delay):
    late.reset()
    with LLM(tiny_model, block_size=4, num_kv_blocks=256, kv_connector=late_config(delay),
             overlap_scheduler=overlap) as producer:
        first = drive(producer, prompts)
    assert first["tokens"] == baseline
    assert len(late.STORE) > 0
    with LLM(tiny_model, block_size=4, num_kv_blocks=256, kv_connector=late_config(delay),
             overlap_scheduler=overlap, enable_prefix_caching=False) as consumer:
        second = drive(consumer, prompts)
        stats = consumer.stats()
    assert second["tokens"] == baseline
    assert all(n >= 24 for n in second["loaded"])
    assert stats["connector_tokens_loaded"] == sum(second["loaded"])


@pytest.mark.parametrize("overlap", [False, True])
def test_late_saves_under_preemption_pressure(tiny_model, prompts, baseline, overlap):
    """A tiny cache forces preemption while saves are pending: the pinned blocks must not be
    reused (a late copy would then save another request's bytes and the consumer differs)."""
    late.reset()
    with LLM(tiny_model, block_size=4, num_kv_blocks=24, kv_connector=late_config(5),
             overlap_scheduler=overlap) as producer:
        first = drive(producer, prompts)
        assert producer.stats()["preemptions"] > 0
    assert first["tokens"] == baseline
    with LLM(tiny_model, block_size=4, num_kv_blocks=256, kv_connector=late_config(2),
             overlap_scheduler=overlap, enable_prefix_caching=False) as consumer:
        assert drive(consumer, prompts)["tokens"] == baseline


WORKER_STEP = re.compile(
    r"bind_connector_meta start_load_kv "
    r"((wait_for_layer_load:(\d) save_kv_layer:\3 )*)"
    r"wait_for_save clear_connector_meta get_finished get_failed_loads")


@pytest.mark.parametrize("overlap", [False, True])
def test_hook_call_order_per_step(tiny_model, prompts, overlap):
    late.reset()
    with LLM(tiny_model, block_size=4, num_kv_blocks=256, kv_connector=late_config(2),
             overlap_scheduler=overlap) as llm:
        assert late.CALLS == [("worker", "register_kv_caches")]
        llm.generate(prompts[:3], SP)
        forward_passes = llm.stats()["forward_passes"]
        iterations = llm.stats()["iterations"]
    worker = " ".join(h for side, h in late.CALLS[1:] if side == "worker") + " "
    steps = [m for m in WORKER_STEP.finditer(worker)]
    assert "".join(m.group(0) + " " for m in steps) == worker  # nothing outside a step
    with_forward = [m for m in steps if m.group(1)]
    assert len(with_forward) == forward_passes
    for m in with_forward:  # every layer, in order, each load-wait before its save
        assert m.group(1).split() == [f"{h}:{i}" for i in range(3)
                                      for h in ("wait_for_layer_load", "save_kv_layer")]
    sched = [h for side, h in late.CALLS if side == "scheduler"]
    assert sched.count("build_connector_meta") == iterations  # every step, also idle ones
    assert sched.count("request_finished") == 3
    assert sched.count("get_num_new_matched_tokens") == sched.count("update_state_after_alloc") == 3
    # per admission: the match is asked, then the allocation reported, before the step's meta
    first_meta = sched.index("build_connector_meta")
    assert sched[:first_meta] == ["get_num_new_matched_tokens", "update_state_after_alloc"] * 3


def test_connector_answers_are_validated(tiny_model, monkeypatch):
    late.reset()
    with LLM(tiny_model, block_size=4, num_kv_blocks=64, kv_connector=late_config()) as llm:
        monkeypatch.setattr(llm.engine.transfers.calls.scheduler, "get_num_new_matched_tokens",
                            lambda req, n: (0, True))
        with pytest.raises(RuntimeError, match=r"\(0, True\)"):
            llm.generate([[1, 2, 3, 4, 5]], SP)


@pytest.mark.parametrize("config, needle", [
    (dict(name="nope"), "unknown connector name 'nope'"),
    (dict(module="no.such.module", scheduler_class="A", worker_class="B"), "cannot be imported"),
    (dict(module="tests.late_connector", scheduler_class="Missing", worker_class="LateWorker"),
     "has no class 'Missing'"),
    (dict(module="tests.late_connector", scheduler_class="LateWorker", worker_class="LateWorker"),
     "not a subclass of KvConnectorScheduler"),
])
def test_bad_connector_config_fails_at_bring_up(tiny_model, config, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        LLM(tiny_model, kv_connector=ConnectorConfig(**config), num_kv_blocks=16)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(name="fs", module="m", scheduler_class="A", worker_class="B"), "not both"),
    (dict(module="m"), "together"), (dict(), "together"),
    (dict(name="fs", transfer_timeout_sec=0), "transfer_timeout_sec"),
    (dict(name="fs", control_grace_sec=float("inf")), "control_grace_sec"),
    (dict(name="fs", transfer_timeout_sec=float("nan")), "transfer_timeout_sec"),
    (dict(name="fs", control_grace_sec=-1), "control_grace_sec"),
    (dict(name="fs", load_failure_policy="ignore"), "load_failure_policy"),
])
def test_connector_config_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ConnectorConfig(**kwargs)


def test_kv_pool_and_kv_connector_together_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        LLM(tiny_model, kv_pool=str(tmp_path), kv_connector=ConnectorConfig(name="fs"))
