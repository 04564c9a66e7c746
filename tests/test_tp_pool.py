"""Connectors under TP: rank 0 decides, every rank saves and loads its own shard."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.kv.block_keys import extend_block_keys, request_seed, shard_key, shard_namespace
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=8)
BS = 4
KW = dict(block_size=BS, num_kv_blocks=128)
TP = 2


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return str(tiny_models["mha_untied"])  # 4 KV heads: 2 per shard


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(512, [40], seed=7)[0]
    return [shared + t for t in random_prompts(512, [3, 9, 17], seed=8)]


@pytest.fixture(scope="module")
def expected(model, prompts):
    with LLM(model, **KW) as llm:
        return [o.token_ids for o in llm.generate(prompts, SP)]


def run_tp(model, pool: Path, prompts, overlap=True):
    """A TP fleet on the pool, every hit loaded whole (these tests count what each shard
    loads; a split depends on measured rates: tests/test_compute_while_loading.py)."""
    cfg = ConnectorConfig(name="fs", options={"root": str(pool)}, compute_while_loading=False)
    with LLM(model, tp_size=TP, kv_connector=cfg, overlap_scheduler=overlap, **KW) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        return [o.token_ids for o in outs], outs, llm.stats(), llm.engine.info.namespace


def shard_file(pool: Path, namespace_hex: str, prompt, block: int, rank: int) -> Path:
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, BS, request_seed(bytes.fromhex(namespace_hex), None))
    return pf.block_path(pool, shard_key(keys[block], rank, TP))


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.extended), True])
def test_tp_round_trip_saves_and_loads_every_shard(model, prompts, expected, tmp_path, overlap):
    produced, _, p_stats, ns = run_tp(model, tmp_path, prompts, overlap)
    consumed, outs, c_stats, _ = run_tp(model, tmp_path, prompts, overlap)
    assert produced == expected and consumed == expected
    # the first request loads the shared blocks; the others hit them locally once landed
    assert outs[0].num_connector_tokens >= 40
    assert all(o.num_connector_tokens + o.num_local_prefix_tokens >= 40 for o in outs)
    saved = [s["blocks_saved"] for s in p_stats["per_rank"]]
    loaded = [s["blocks_loaded"] for s in c_stats["per_rank"]]
    assert saved[0] == saved[1] > 0 and loaded[0] == loaded[1] > 0  # each rank its shard
    assert len(list(pf.iter_block_files(tmp_path))) == TP * saved[0]
    # rank 0 alone asked the pool; its answers were every rank's
    assert c_stats["per_rank"][0]["pool_lookups"] == len(prompts)
    assert c_stats["per_rank"][1]["pool_lookups"] == 0
    # a shard file names its shard: rank r's file holds rank r's namespace
    with open(shard_file(tmp_path, ns, prompts[0], 0, 1), "rb") as f:
        header = pf.parse_header(f.read(pf.HEADER_SIZE))
    assert header.namespace == shard_namespace(bytes.fromhex(ns), 1, TP)


@pytest.mark.parametrize("damage", [pytest.param("deleted", marks=pytest.mark.extended), "corrupted"])
def test_one_bad_shard_is_a_miss_on_every_rank(model, prompts, expected, tmp_path, damage):
    _, _, _, ns = run_tp(model, tmp_path, prompts[:1])  # the pool holds prompt 0's blocks
    bad = shard_file(tmp_path, ns, prompts[0], 3, 1)  # rank 1's shard of block 3
    if damage == "deleted":
        bad.unlink()
    else:
        data = bytearray(bad.read_bytes())
        data[-5] ^= 0xFF
        bad.write_bytes(bytes(data))
    tokens, outs, stats, _ = run_tp(model, tmp_path, prompts[:1])
    assert tokens == expected[:1]
    assert outs[0].num_connector_tokens == 3 * BS  # blocks 0-2 loaded, 3 on recomputed
    r0, r1 = stats["per_rank"]
    # every rank kept the same loaded prefix and recomputed the rest
    assert r0["connector_tokens_loaded"] == r1["connector_tokens_loaded"] == 3 * BS
    if damage == "corrupted":  # found by rank 1's read; the ranks agreed to recompute
        assert r1["corrupt_blocks"] == 1 and r0["corrupt_blocks"] == 0
        assert r0["load_failures_recomputed"] == r1["load_failures_recomputed"] == 1
    else:  # rank 0's lookup saw the missing shard: blocks 3+ were never read anywhere
        assert r0["pool_hit_blocks"] == 3 and r0["load_failures_recomputed"] == 0
        assert r0["blocks_loaded"] == r1["blocks_loaded"] == 3
    assert bad.exists() and pf.parse_header(bad.read_bytes()[:pf.HEADER_SIZE])  # re-saved


@pytest.mark.parametrize("overlap", [False, True])
def test_transfer_finishes_only_when_every_rank_reports(model, prompts, overlap):
    """Rank 1's copies land 6 polls after rank 0's. Were a load taken as done on rank 0's
    word, rank 1 would compute on blocks not yet filled; were a save, its blocks would be
    reused (the cache is small, no local prefix cache) before rank 1 copied them out."""
    kw = dict(block_size=BS, num_kv_blocks=40, enable_prefix_caching=False,
              overlap_scheduler=overlap)
    with LLM(model, **kw) as llm:
        expected = [[o.token_ids for o in llm.generate(p, SP)] for p in (prompts[:1], prompts)]
    cfg = ConnectorConfig(module="tests.late_connector", scheduler_class="LateScheduler",
                          worker_class="LateWorker", options={"delay_polls": [1, 7]})
    with LLM(model, tp_size=TP, kv_connector=cfg, **kw) as llm:
        first = [o.token_ids for o in llm.generate(prompts[:1], SP)]  # saves prompt 0's blocks
        outs = llm.generate(prompts, SP)  # loads them for all three
        llm.check_integrity()
        per_rank = llm.stats()["per_rank"]
    assert [first, [o.token_ids for o in outs]] == expected
    assert all(o.num_connector_tokens >= 40 for o in outs)
    assert per_rank[0]["connector_tokens_loaded"] == per_rank[1]["connector_tokens_loaded"] >= 120


# -- the failure policy under TP (the one-rank and ADP matrix: tests/test_failure_policy.py) --

def fault_cfg(root, fault, timeout=600.0):
    return ConnectorConfig(module="tests.fault_connector", scheduler_class="FaultScheduler",
                           worker_class="FaultWorker", options={"root": str(root), "fault": fault},
                           transfer_timeout_sec=timeout, control_grace_sec=0.5)


@pytest.mark.parametrize("hook, rank", [("build_connector_meta", 0), ("get_finished", 1)])
def test_tp_connector_failure_stops_every_rank_alike(model, prompts, tmp_path, hook, rank):
    from shoal.connectors import ConnectorError
    llm = LLM(model, tp_size=TP, kv_connector=fault_cfg(tmp_path, {"raise_in": hook,
                                                                   "rank": rank}), **KW)
    with pytest.raises(ConnectorError, match=f"{hook} raised InjectedFault") as info:
        llm.generate(prompts, SP)
    assert f"rank {rank}" in str(info.value) and "must be restarted" in str(info.value)
    assert sorted(info.value.rank_messages) == [0, 1]
    assert len(set(info.value.rank_messages.values())) == 1
    llm.shutdown()


def test_tp_hook_that_blocks_on_rank_1_stops_the_fleet(model, prompts, tmp_path):
    # rank 1 never comes back from its worker hook: its watchdog ends it, saying why
    from shoal.connectors import ConnectorError
    cfg = fault_cfg(tmp_path, {"block_in": "wait_for_save", "rank": 1}, timeout=1.5)
    llm = LLM(model, tp_size=TP, kv_connector=cfg, **KW)
    handles = [llm.submit(p, SP) for p in prompts]
    with pytest.raises(ConnectorError, match="worker wait_for_save did not return within") as info:
        [h.result(timeout=90) for h in handles]
    assert "rank 1" in str(info.value) and "must be restarted" in str(info.value)
    assert 1 in info.value.rank_messages
    llm.shutdown()


def test_tp_load_stalled_on_one_rank_is_aborted_on_all(model, prompts, expected, tmp_path):
    run_tp(model, tmp_path, prompts[:1])  # the pool holds prompt 0's blocks
    cfg = fault_cfg(tmp_path, {"load_polls": -1, "rank": 1}, timeout=1.5)
    with LLM(model, tp_size=TP, kv_connector=cfg, **KW) as llm:
        out = llm.generate(prompts[:1], SP)[0]  # rank 0 loads; rank 1 never does
        assert out.finish_reason == "error" and "aborted" in out.error
        llm.check_integrity()
        h = llm.submit(prompts[1][-9:], SamplingParams(max_tokens=10_000, ignore_eos=True))
        next(h.stream())
        h.cancel()  # the engine goes on, and a cancel reaches every rank
        assert h.result(timeout=60).finish_reason == "cancelled"
        llm.check_integrity()
        per_rank = llm.stats()["per_rank"]
    assert [s["transfers_aborted"] for s in per_rank] == [1, 1]  # agreed: both aborted
    assert [s["cancellations"] for s in per_rank] == [1, 1]
