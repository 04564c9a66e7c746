"""A pool hit's front computed while its back loads (SPEC 3.1), against runs without a pool.

The planner's rates are pinned (measurements switched off) and the pool's reads paced with
`max_read_gbps`, so each test knows how its hit is split at admission; what happens after
follows the real progress of the load, and every assertion holds whatever it is."""

from __future__ import annotations

import time

import pytest

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.kv.block_keys import extend_block_keys, request_seed
from tests.conftest import count_lookups, random_prompts

SP = SamplingParams(max_tokens=8)
KW = dict(block_size=4, num_kv_blocks=128)
BLOCK_NBYTES = 3 * 2 * 4 * 2 * 16 * 4  # the tiny model's block: layers, K+V, tokens, heads, dim
PER_BLOCK_S = 0.02  # the paced pool reads a block in this time


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(512, [42], seed=11)[0]  # 10 full blocks of 4 in the pool, then 2


@pytest.fixture(scope="module")
def baseline(tiny_model, prompt):
    with LLM(tiny_model, **KW) as llm:
        return llm.generate([prompt], SP)[0].token_ids


@pytest.fixture
def pool(tiny_model, prompt, tmp_path):
    root = tmp_path / "pool"
    with LLM(tiny_model, kv_pool=str(root), **KW) as llm:
        llm.generate([prompt], SP)
        assert llm.stats()["blocks_saved"] == 10
    return root


def paced(root, per_block_s=PER_BLOCK_S, **kw) -> ConnectorConfig:
    return ConnectorConfig(name="fs", options={"root": str(root),
                                               "max_read_gbps": BLOCK_NBYTES / per_block_s / 1e9},
                           **kw)


def pin_rates(llm: LLM, prefill: float, load: float, latency: float = 0.0) -> None:
    """The planner decides from these rates and measures nothing."""
    p = llm.engine.transfers.planner
    p.prefill_tps.value, p.load_tps.value, p.load_latency_s.value = prefill, load, latency
    p.prefill_overhead_s = 0.0
    p.observe_prefill = p.observe_load = p.observe_front = lambda *a, **k: None
    p.front_slowdown.value = p.load_slowdown.value = None  # (as a rates file may restore)
    # nor the load in flight: its own rate (landed / waited) is not taken for L either
    p._load_rate = lambda num_landed, waited, host_share, num_pending, ahead=0: (
        load, max(latency - (waited or 0.0), 0.0) + (ahead / load if waited is None else 0.0),
        1.0)


def block_key(llm: LLM, prompt: list[int], i: int) -> bytes:
    keys: list[bytes] = []
    extend_block_keys(keys, prompt, 4, request_seed(bytes.fromhex(llm.engine.info.namespace), None))
    return keys[i]


def split_run(model, cfg, prompt, rates=(400.0, 200.0), **kw):
    """One request on a fresh engine whose rates are pinned so that its hit is split
    (C = 400 tokens/s, L = 200: they meet after about 40 / 600 s, 26.7 tokens into the
    hit; of the block boundaries around it the front's share is 28 tokens, where both end
    sooner: the front in 0.073 s, the load of 12 in 0.06; at 24 the load of 16 takes 0.08):
    its output and the engine's stats, every block accounted for."""
    with LLM(model, kv_connector=cfg, **KW, **kw) as llm:
        pin_rates(llm, prefill=rates[0], load=rates[1])
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
        return out, llm.stats()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_front_computes_while_the_back_loads(tiny_model, prompt, baseline, pool, overlap,
                                                 monkeypatch):
    from shoal.connectors.fs.connector import FsPoolScheduler

    outputs = []
    real = FsPoolScheduler.build_connector_meta
    monkeypatch.setattr(FsPoolScheduler, "build_connector_meta",
                        lambda self, so: (outputs.append(so), real(self, so))[1])
    out, s = split_run(tiny_model, paced(pool), prompt, overlap_scheduler=overlap)
    assert out.token_ids == baseline
    # the connector sees each request once a step: the admission step's front chunk reports
    # it as new, from the position the chunk starts at
    for so in outputs:
        ids = [rd.request_id for rd in (*so.new_requests, *so.cached_requests)]
        assert len(ids) == len(set(ids)), ids
    first = next(rd for so in outputs for rd in so.new_requests)
    assert first.computed_position == 0 and first.num_scheduled_tokens == 28  # the share
    hit = out.pool_hit
    assert hit.decision == "split" and hit.num_matched_tokens == 40
    assert hit.num_front_tokens >= 12 and hit.num_front_tokens % 4 == 0
    assert hit.num_front_tokens + hit.num_loaded_tokens == 40  # every matched token, once
    assert out.num_connector_tokens == hit.num_loaded_tokens
    assert s["pool_hits_split"] == 1 and s["front_tokens_computed"] == hit.num_front_tokens
    assert s["connector_tokens_loaded"] == hit.num_loaded_tokens
    assert s["blocks_loaded"] * 4 >= hit.num_loaded_tokens  # landed blocks the front passed too


def test_a_split_s_load_teaches_its_slowdown_or_a_faster_rate(tiny_model, prompt, baseline,
                                                                   pool):
    """The split's load runs beside its front: what it measures is how much longer it took
    than the store's rate says (`load_slowdown`), not the store's rate, which loads alone
    measure (a slowed load taught as the store's rate made every next hit split again). One
    faster than that rate says the store is at least that fast (here: reads not paced, the
    rate pinned low)."""
    with LLM(tiny_model, kv_pool=str(pool), **KW) as llm:  # (reads not paced: a load that
        pin_rates(llm, prefill=400.0, load=200.0)  # lands before the front reaches it)
        del llm.engine.transfers.planner.observe_load  # the real measurement, this time
        out = llm.generate([prompt], SP)[0]
        s = llm.stats()
    assert out.token_ids == baseline and out.pool_hit.decision == "split"
    assert out.pool_hit.num_loaded_tokens > 0
    assert s["load_slowdown"] == 1.0  # measured (0: never), faster than the pinned rate
    assert s["load_tokens_per_s"] > 200.0


def test_a_store_slower_than_computing_is_not_read(tiny_model, prompt, baseline, pool,
                                                   monkeypatch):
    looked = count_lookups(monkeypatch)
    with LLM(tiny_model, kv_connector=paced(pool), **KW) as llm:
        pin_rates(llm, prefill=10_000.0, load=10.0)  # the load would not add a block
        out = llm.generate([prompt], SP)[0]
        s = llm.stats()
        keys = [block_key(llm, prompt, i) for i in range(10)]
    assert out.token_ids == baseline
    assert out.pool_hit.decision == "compute" and out.num_connector_tokens == 0
    assert out.pool_hit.num_front_tokens == 40
    assert s["blocks_loaded"] == 0 and s["pool_hits_computed"] == 1
    # found at admission, and not looked for again when the computed blocks are saved
    assert [looked.get(pf.block_path_str(str(pool), k)) for k in keys] == [1] * 10


def test_a_store_faster_than_computing_is_read_whole(tiny_model, prompt, baseline, pool):
    with LLM(tiny_model, kv_pool=str(pool), **KW) as llm:
        pin_rates(llm, prefill=1.0, load=1e9)  # not one block could be computed first
        out = llm.generate([prompt], SP)[0]
        s = llm.stats()
    assert out.token_ids == baseline
    assert out.pool_hit.decision == "load" and out.num_connector_tokens == 40
    assert out.pool_hit.num_front_tokens == 0 and s["pool_hits_loaded"] == 1


def test_loads_waiting_their_turn_are_not_taken_for_a_dead_slow_store(tiny_model, tmp_path):
    """Three pooled documents hit at once in a fresh engine that knows no load rate (the
    first touches after a restart): the store (one I/O thread, paced) serves the loads in
    turn. A load waiting for its turn has landed nothing, and so once looked dead slow:
    past UNKNOWN_LOAD_WAIT of the hit's compute time its front computed the whole hit. Its
    wait counts from its turn now: every hit is loaded, and the rates it teaches are the
    store's, not the queue's."""
    prompts = random_prompts(512, [42, 42, 42], seed=12)
    root = tmp_path / "pool"
    with LLM(tiny_model, kv_pool=str(root), **KW) as llm:
        baseline = [o.token_ids for o in llm.generate(prompts, SP)]
        assert llm.stats()["blocks_saved"] == 30
    cfg = ConnectorConfig(name="fs", options={
        "root": str(root), "io_threads": 1, "max_read_gbps": BLOCK_NBYTES / PER_BLOCK_S / 1e9})
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        p = llm.engine.transfers.planner
        assert p.load_tps.value is None and p.load_latency_s.value is None
        # computing a hit (40 tokens) takes 2 s: a front waits 0.1 s for a first block, and
        # a load takes 0.2 s (10 blocks), so the second and third wait longer for their turn
        p.prefill_tps.value, p.prefill_overhead_s, p.prefill_launch_s = 20.0, 0.0, 0.0
        p.observe_prefill = p.observe_front = lambda *a, **k: None
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        s = llm.stats()
    assert [o.token_ids for o in outs] == baseline
    for o in outs:  # (once a load's own rate is known, the planner may give the front a
        # few blocks: under a busy CPU up to 2; before, the second document loaded none)
        assert o.pool_hit.num_loaded_tokens >= 20 and o.num_connector_tokens >= 20
    assert s["pool_hits_loaded"] == 3
    # a first block after about PER_BLOCK_S from when the store began each load (from their
    # admission: 0.02, 0.22 and 0.42 s, averaged to about 0.27)
    assert s["load_latency_s"] < 4 * PER_BLOCK_S


def test_units_landing_out_of_order_are_all_used(tiny_model, prompt, baseline, pool):
    """The load's back unit lands last: for a while blocks 0-5 have landed below blocks
    6-9 still being copied (writes_from 6). Once all have landed, the request uses every
    loaded block; the front computes none of them again."""
    cfg = ConnectorConfig(module="tests.gated_fs_connector", scheduler_class="FsPoolScheduler",
                          worker_class="BackLastFsWorker",
                          options={"root": str(pool), "io_threads": 2})
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        pin_rates(llm, prefill=1.0, load=1e9)  # the front waits for the load
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
    assert out.token_ids == baseline
    assert out.num_connector_tokens == 40 and out.pool_hit.num_front_tokens == 0


def test_a_corrupt_block_in_the_loaded_half_is_recomputed(tiny_model, prompt, baseline, pool):
    """C = 200, L = 400: however the load progresses, each step's split leaves the front
    short of blocks 8 and 9, which the load reads (the front never drops them)."""
    with LLM(tiny_model, kv_pool=str(pool), **KW) as probe:
        bad = block_key(probe, prompt, 9)  # the last: the first block the load reads
    path = pf.block_path(pool, bad)
    data = bytearray(path.read_bytes())
    data[pf.HEADER_SIZE + 5] ^= 0x40
    path.write_bytes(bytes(data))
    out, s = split_run(tiny_model, paced(pool), prompt, rates=(200.0, 400.0))
    assert out.token_ids == baseline
    hit = out.pool_hit
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    assert hit.num_front_tokens + hit.num_loaded_tokens <= 36  # block 9 was recomputed
    assert len(list((pool / "quarantine").iterdir())) == 1


def test_a_load_failing_in_the_loaded_half_is_recomputed(tiny_model, prompt, baseline, pool):
    with LLM(tiny_model, kv_pool=str(pool), **KW) as probe:
        gone = pf.block_path(pool, block_key(probe, prompt, 9))
    gone.unlink()  # after no lookup: the pool no longer has block 9, the hit is blocks 0-8
    out, _ = split_run(tiny_model, paced(pool), prompt)
    assert out.token_ids == baseline and out.pool_hit.num_matched_tokens == 36


def test_policy_fail_ends_the_request_with_an_error(tiny_model, prompt, pool, monkeypatch):
    real = pf.read_block_into

    def missing_back(root, namespace, key, dest, shape, dtype, **kw):
        raise pf.BlockMissing(key.hex())  # every file vanished after the lookup
    monkeypatch.setattr(pf, "read_block_into", missing_back)
    with LLM(tiny_model, kv_connector=paced(pool, load_failure_policy="fail"), **KW) as llm:
        pin_rates(llm, prefill=200.0, load=400.0)  # the front leaves blocks 8, 9 to the load
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
        monkeypatch.setattr(pf, "read_block_into", real)
        again = llm.generate([prompt[:5]], SP)[0]  # the engine goes on
    assert out.finish_reason == "error" and "failed at block" in out.error, out.pool_hit
    assert again.finish_reason == "length"


def test_cancel_mid_load_waits_for_the_copies_and_leaks_nothing(tiny_model, prompt, pool):
    with LLM(tiny_model, kv_connector=paced(pool, per_block_s=0.1), **KW) as llm:
        pin_rates(llm, prefill=400.0, load=200.0)
        h = llm.submit(prompt, SP)
        deadline = time.monotonic() + 60
        while llm.stats()["pool_hits_split"] == 0:  # admitted: its load is pending now
            assert time.monotonic() < deadline, "the request was never admitted"
        h.cancel()
        out = h.result(timeout=60)
        llm.check_integrity()
        assert llm.stats()["kv_blocks_used"] == 0  # every block of the cancelled load let go
    assert out.finish_reason == "cancelled"


def test_a_deadline_mid_load_aborts_it_and_the_engine_goes_on(tiny_model, prompt, pool):
    # 10 blocks at 0.1 s each: the load outlasts its deadline; the abort waits for the
    # block each I/O thread is reading, no more
    cfg = paced(pool, per_block_s=0.1, transfer_timeout_sec=0.5)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        pin_rates(llm, prefill=40.0, load=1000.0)
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
        s = llm.stats()
        again = llm.generate([prompt[:5]], SP)[0]
    assert out.finish_reason == "error" and "deadline" in out.error
    assert s["deadline_expiries"] >= 1 and s["transfers_aborted"] >= 1
    assert again.finish_reason == "length"


def test_whole_loads_when_asked(tiny_model, prompt, baseline, pool):
    cfg = ConnectorConfig(name="fs", options={"root": str(pool)}, compute_while_loading=False)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        pin_rates(llm, prefill=1e9, load=1.0)  # would compute it all if it could choose
        out = llm.generate([prompt], SP)[0]
    assert out.token_ids == baseline and out.num_connector_tokens == 40
    assert out.pool_hit.decision == "load"


def test_the_bring_up_probe_fits_a_short_context(tiny_model, prompt, baseline, pool):
    """A context shorter than the prefill probe (128 tokens on CPU): the probe is cut to it
    (it takes a block-table row, as a request does) and the pool still serves."""
    with LLM(tiny_model, kv_pool=str(pool), max_model_len=64, **KW) as llm:
        assert llm.engine.runner.table_width * 4 == 64
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
    assert out.token_ids == baseline and out.num_connector_tokens > 0


@pytest.mark.parametrize("parallel", [dict(dp_size=2), dict(tp_size=2)])
def test_under_adp_and_tp_every_hit_is_served_once(tiny_model, prompt, baseline, tmp_path,
                                                   parallel):
    """Rank processes decide from their own measured rates (the paced reads make the load
    slow against the tiny model's compute, so fronts compute); under TP the lead decides
    for every rank. Whatever the split: the no-pool tokens, every matched token computed
    or loaded once (a request whose shared blocks another request of its rank brings in
    waits for them and hits them locally)."""
    prompts = [prompt, prompt[:30] + [7, 8, 9]]
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    assert expected[0] == baseline
    pool = tmp_path / "pool"  # saved by the same kind of fleet (TP pool keys name the shard)
    with LLM(tiny_model, kv_pool=str(pool), **parallel, **KW) as llm:
        llm.generate([prompt], SP)
    with LLM(tiny_model, kv_connector=paced(pool), **parallel, **KW) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected
    assert outs[0].pool_hit is not None
    for out in outs:
        hit = out.pool_hit
        if hit is None:  # the first one's hit, on its rank
            assert out is outs[1] and out.num_local_prefix_tokens == 28
            continue
        assert hit.num_matched_tokens in (40, 28)
        assert hit.num_front_tokens + hit.num_loaded_tokens == hit.num_matched_tokens
