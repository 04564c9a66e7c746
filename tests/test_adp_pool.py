"""Connectors under attention DP: owner-local adapters sharing one persistent pool."""

from __future__ import annotations

import multiprocessing

import pytest

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.request import NewRequest
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=8)
KW = dict(block_size=4, num_kv_blocks=128)

WORKLOADS = {  # prompts: a shared 40-token prefix + tails (full blocks are pool material)
    "one_request_idle_owner": [3],
    "four_equal": [5, 5, 5, 5],
    "unequal_lengths": [1, 30, 6, 55],
}


def prompts_for(name):
    shared = random_prompts(512, [40], seed=7)[0]
    return [shared + t for t in random_prompts(512, WORKLOADS[name], seed=8)]


# every workload in both loops; two of the six by default, the rest `extended`
ROUND_TRIPS = [pytest.param(w, o, marks=() if (w, o) in {("unequal_lengths", True),
                                                        ("one_request_idle_owner", False)}
                            else pytest.mark.extended, id=f"{o}-{w}")
               for w in sorted(WORKLOADS) for o in (False, True)]


@pytest.mark.parametrize("workload, overlap", ROUND_TRIPS)
def test_adp_persistent_pool_round_trip(tiny_model, tmp_path, workload, overlap):
    prompts = prompts_for(workload)
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    runs = []
    # whole loads: every busy owner loads (a split depends on measured rates)
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path)}, compute_while_loading=False)
    for _ in ("producer", "consumer"):  # two fleets, one pool
        with LLM(tiny_model, dp_size=2, kv_connector=cfg, overlap_scheduler=overlap,
                 **KW) as llm:
            outs = llm.generate(prompts, SP)
            llm.check_integrity()
            runs.append((outs, llm.stats()))
    (produced, p_stats), (consumed, c_stats) = runs
    assert [o.token_ids for o in produced] == expected
    assert [o.token_ids for o in consumed] == expected
    # each busy owner loads the shared blocks once; its later requests hit them locally
    assert all(o.num_connector_tokens + o.num_local_prefix_tokens >= 40 for o in consumed)
    busy = [s for s in c_stats["per_rank"] if s["prompt_tokens"] > 0]
    assert len(busy) == min(2, len(prompts))
    assert all(s["connector_tokens_loaded"] > 0 for s in busy)  # every busy owner loaded
    assert c_stats["blocks_saved"] == 0
    # owners racing to save the same key publish it once (link never overwrites)
    assert p_stats["blocks_saved"] == len(list(pf.iter_block_files(tmp_path))) > 0
    for s in (*p_stats["per_rank"], *c_stats["per_rank"]):
        assert s["control_collectives"] == s["iterations"]  # one small all-gather per step


def test_save_on_owner_1_completes_with_owner_0_idle(tiny_model, tmp_path):
    short = random_prompts(512, [2], seed=1)[0]  # -> owner 0, no full block to save
    long = random_prompts(512, [41], seed=2)[0]  # -> owner 1, ten blocks to save
    with LLM(tiny_model, dp_size=2, kv_pool=str(tmp_path), **KW) as llm:
        outs = llm.generate([short, long], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=6)])
        owner0, owner1 = llm.stats()["per_rank"]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert owner0["blocks_saved"] == 0 and owner0["prompt_tokens"] == 2
    assert owner1["blocks_saved"] == 10
    assert len(list(pf.iter_block_files(tmp_path))) == 10  # published before generate returned


@pytest.mark.parametrize("scheduler_class, worker_class, refused", [
    ("NoDpScheduler", "LateWorker", "NoDpScheduler"),
    ("LateScheduler", "NoDpWorker", "NoDpWorker"),
])
def test_non_opted_connector_refused_before_any_process(tiny_model, scheduler_class,
                                                        worker_class, refused):
    cfg = ConnectorConfig(module="tests.late_connector", scheduler_class=scheduler_class,
                          worker_class=worker_class)
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=f"{refused} does not declare supports_attention_dp"):
        LLM(tiny_model, dp_size=2, kv_connector=cfg, **KW)
    assert len(multiprocessing.active_children()) == before  # nothing was started



def test_loading_owner_never_stalls_the_busy_owner(tiny_model, tmp_path, monkeypatch):
    import os
    import time

    pool = tmp_path / "pool"
    shared = random_prompts(512, [40], seed=7)[0]
    a, b = shared + [5, 6, 7], random_prompts(512, [9], seed=3)[0]
    long = SamplingParams(max_tokens=24)
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate([a, b], [SP, long])]
    with LLM(tiny_model, kv_pool=str(pool), **KW) as llm:  # puts a's prefix (only) in the pool
        llm.generate([a], SP)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    monkeypatch.setenv("SHOAL_TEST_LOAD_GATE", str(gate))
    cfg = ConnectorConfig(module="tests.gated_fs_connector", scheduler_class="FsPoolScheduler",
                          worker_class="GatedFsWorker", options={"root": str(pool)},
                          compute_while_loading=False)
    with LLM(tiny_model, dp_size=2, kv_connector=cfg, **KW) as llm:
        fleet = llm.engine
        rid_a = fleet.add(NewRequest(a, SP))  # owner 0: a pool hit, its load waits at the gate
        rid_b = fleet.add(NewRequest(b, long))  # owner 1: computes meanwhile
        done, start = {}, time.monotonic()
        while rid_b not in done and time.monotonic() - start < 120:
            done.update((o.request_id, o) for o in fleet.step().finished)
        assert rid_b in done and rid_a not in done  # b ran all 24 tokens while a was loading
        with open(gate, "wb"):  # open the gate: a's load proceeds
            while rid_a not in done and time.monotonic() - start < 120:
                done.update((o.request_id, o) for o in fleet.step().finished)
        per_rank = llm.stats()["per_rank"]
    assert [done[rid_a].token_ids, done[rid_b].token_ids] == expected
    assert done[rid_a].num_connector_tokens == 40
    assert per_rank[0]["connector_tokens_loaded"] == 40 and per_rank[1]["prompt_tokens"] == 9
