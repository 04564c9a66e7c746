"""Deadlines, cancellation, shutdown drain and the fatal policy (SPEC 6), by fault injection.

Every case runs the real fs pool through tests/fault_connector.py on one rank and on two
ADP ranks, in both executor loops, and asserts the outcome, that it came within a
generous bound, that no pinned block was freed (check_integrity) and that each request
ended exactly once (one result per handle, none reported twice).
"""

from __future__ import annotations

import time

import pytest

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig, ConnectorError
from shoal.connectors.fs import format as pf
from tests import fault_connector
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=6)
KW = dict(block_size=4, num_kv_blocks=128)
TIMEOUT, GRACE = 1.5, 0.5
BOUND = TIMEOUT + GRACE + 60  # generous: timeouts + grace + model and process start-up
# one rank in the plain loop and two ADP owners in the overlap loop by default; the two
# other combinations are `extended` (make test-all)
MODES = [pytest.param(1, False, id="1rank-plain"),
         pytest.param(1, True, id="1rank-overlap", marks=pytest.mark.extended),
         pytest.param(2, False, id="adp2-plain", marks=pytest.mark.extended),
         pytest.param(2, True, id="adp2-overlap")]
OVERLAP = [pytest.param(False, marks=pytest.mark.extended), True]  # the overlap loop by default


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(512, [40], seed=7)[0]
    return [shared + t for t in random_prompts(512, [3, 11], seed=8)]


@pytest.fixture(scope="module")
def expected(tiny_model, prompts):
    with LLM(tiny_model, **KW) as llm:
        return [o.token_ids for o in llm.generate(prompts, SP)]


@pytest.fixture
def warm_pool(tiny_model, prompts, tmp_path):
    """A pool holding the prompts' blocks (so requests load)."""
    with LLM(tiny_model, kv_pool=str(tmp_path), **KW) as llm:
        llm.generate(prompts, SP)
    return tmp_path


def faulty(root, fault: dict, abort=True, timeout=TIMEOUT, grace=GRACE) -> ConnectorConfig:
    return ConnectorConfig(module="tests.fault_connector", scheduler_class="FaultScheduler",
                           worker_class="FaultWorker" if abort else "NoAbortFaultWorker",
                           options={"root": str(root), "fault": fault},
                           transfer_timeout_sec=timeout, control_grace_sec=grace)


def make_llm(model, cfg, dp, overlap):
    return LLM(model, kv_connector=cfg, dp_size=dp, overlap_scheduler=overlap, **KW)


def results(handles, bound=BOUND):
    """Every handle's output (each exactly once), waiting on the handles, not sleeping."""
    start = time.monotonic()
    outs = [h.result(timeout=bound) for h in handles]
    assert time.monotonic() - start < bound
    assert len({o.request_id for o in outs}) == len(handles)
    return outs


# -- normal outcomes -----------------------------------------------------------------------

@pytest.mark.parametrize("dp, overlap", MODES)
def test_transfers_finishing_late_change_nothing(tiny_model, prompts, warm_pool, dp, overlap):
    # the shared 40-token prefix loads from the pool; the new tails' blocks are saved
    tails = [prompts[0][:40] + t for t in random_prompts(512, [13, 21], seed=9)]
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(tails, SP)]
    before = len(list(pf.iter_block_files(warm_pool)))
    cfg = faulty(warm_pool, {"load_polls": 4, "save_polls": 4}, timeout=600)
    with make_llm(tiny_model, cfg, dp, overlap) as llm:
        outs = results([llm.submit(p, SP) for p in tails])
        llm.check_integrity()
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert [o.finish_reason for o in outs] == ["length", "length"]
    # the first loads the prefix; the second (a separate submit) loads it too, or finds it
    # in the local prefix cache if the first's load was already done when it arrived
    assert outs[0].num_connector_tokens == 40
    assert all(o.num_connector_tokens + o.num_local_prefix_tokens == 40 for o in outs)
    assert stats["deadline_expiries"] == 0
    # the late saves landed before the engine stopped: 3 + 5 new full blocks
    assert len(list(pf.iter_block_files(warm_pool))) == before + 8


# -- fatal: hook exceptions, expired deadlines without abort --------------------------------

SCHEDULER_HOOKS = ["get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "request_finished"]
WORKER_HOOKS = ["start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                "get_finished"]


def assert_fatal(llm, run, *needles):
    """run() fails with a ConnectorError naming what failed, within the bound; every later
    call fails with the same error."""
    start = time.monotonic()
    with pytest.raises(ConnectorError) as info:
        run()
    assert time.monotonic() - start < BOUND
    for needle in (*needles, "must be restarted"):
        assert needle in str(info.value), str(info.value)
    with pytest.raises(ConnectorError) as again:
        llm.generate([[1, 2, 3]], SP)
    assert str(again.value) == str(info.value)
    return info.value


@pytest.mark.parametrize("hook", SCHEDULER_HOOKS + WORKER_HOOKS)
@pytest.mark.parametrize("overlap", [False, True])
def test_hook_exception_is_fatal_on_one_rank(tiny_model, prompts, warm_pool, hook, overlap):
    cfg = faulty(warm_pool, {"raise_in": hook}, timeout=600)
    llm = make_llm(tiny_model, cfg, 1, overlap)
    assert_fatal(llm, lambda: llm.generate(prompts, SP), hook, "owner 0", "InjectedFault")
    llm.shutdown()  # returns: nothing is waited for after a fatal failure


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "wait_for_layer_load",
                                  "get_finished"])
@pytest.mark.parametrize("overlap", OVERLAP)
def test_hook_exception_on_owner_1_stops_every_rank_alike(tiny_model, prompts, warm_pool,
                                                          hook, overlap):
    cfg = faulty(warm_pool, {"raise_in": hook, "rank": 1}, timeout=600)
    llm = make_llm(tiny_model, cfg, 2, overlap)
    error = assert_fatal(llm, lambda: llm.generate(prompts, SP), hook, "owner 1")  # 1 each
    assert sorted(error.rank_messages) == [0, 1]  # both ranks raised, the same message
    assert len(set(error.rank_messages.values())) == 1
    llm.shutdown()


@pytest.fixture
def blocking_hooks():
    """Hooks that block (fault "block_in") return once the test is over: on one rank they
    hold a thread of this process."""
    fault_connector.RELEASE.clear()
    yield
    fault_connector.RELEASE.set()


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "wait_for_layer_load",
                                  "get_finished"])
@pytest.mark.parametrize("overlap", OVERLAP)
def test_hook_that_blocks_is_fatal_on_one_rank(tiny_model, prompts, warm_pool, blocking_hooks,
                                               hook, overlap):
    # the engine's thread never comes back from the hook: the watchdog fails the handles
    llm = make_llm(tiny_model, faulty(warm_pool, {"block_in": hook}), 1, overlap)
    start = time.monotonic()
    assert_fatal(llm, lambda: results([llm.submit(p, SP) for p in prompts]), hook,
                 "did not return within", "owner 0")
    assert time.monotonic() - start >= TIMEOUT  # not before the limit
    llm.shutdown()  # returns, though the engine's thread is still in the hook
    assert not fault_connector.RELEASE.is_set()


@pytest.mark.parametrize("hook", ["get_num_new_matched_tokens", "wait_for_layer_load"])
def test_hook_that_blocks_on_owner_1_stops_the_fleet(tiny_model, prompts, warm_pool, hook):
    # owner 1 ends itself (its peers wait for it in a collective) and says why
    llm = make_llm(tiny_model, faulty(warm_pool, {"block_in": hook, "rank": 1}), 2, False)
    error = assert_fatal(llm, lambda: results([llm.submit(p, SP) for p in prompts]), hook,
                         "did not return within", "owner 1")
    assert 1 in error.rank_messages
    llm.shutdown()


@pytest.mark.parametrize("dp, overlap", MODES)
@pytest.mark.parametrize("stalled", ["load", "save"])
def test_stalled_transfer_without_abort_is_fatal_at_its_deadline(tiny_model, prompts, warm_pool,
                                                                tmp_path, dp, overlap, stalled):
    root = warm_pool if stalled == "load" else tmp_path / "cold"
    cfg = faulty(root, {f"{stalled}_polls": -1}, abort=False)
    llm = make_llm(tiny_model, cfg, dp, overlap)
    start = time.monotonic()
    assert_fatal(llm, lambda: llm.generate(prompts, SP), "passed its deadline", "request req-")
    assert time.monotonic() - start >= TIMEOUT  # not before the deadline
    llm.shutdown()


# -- abort-capable: the request errs, the engine goes on -------------------------------------

@pytest.mark.parametrize("dp, overlap", MODES)
def test_stalled_load_with_abort_fails_that_request_only(tiny_model, prompts, expected,
                                                         warm_pool, dp, overlap):
    cfg = faulty(warm_pool, {"load_polls": -1})
    with make_llm(tiny_model, cfg, dp, overlap) as llm:
        outs = results([llm.submit(p, SP) for p in prompts])
        assert [o.finish_reason for o in outs] == ["error", "error"]
        assert all("aborted" in o.error for o in outs)
        llm.check_integrity()
        # the engine goes on: a prompt with no pool blocks runs normally
        again = llm.generate([[9, 8, 7, 6, 5]], SP)[0]
        assert again.finish_reason == "length"
        stats = llm.stats()
    assert stats["deadline_expiries"] == 2 and stats["transfers_aborted"] == 2


@pytest.mark.parametrize("dp, overlap", MODES)
def test_stalled_save_with_abort_keeps_the_tokens_and_reports_the_error(
        tiny_model, prompts, expected, tmp_path, dp, overlap):
    cfg = faulty(tmp_path, {"save_polls": -1})
    with make_llm(tiny_model, cfg, dp, overlap) as llm:
        outs = results([llm.submit(p, SP) for p in prompts])
        llm.check_integrity()
    assert [o.token_ids for o in outs] == expected  # the tokens were right; the save failed
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("save" in o.error for o in outs)
    assert list(pf.iter_block_files(tmp_path)) == []


# -- cancel -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dp, overlap", MODES)
def test_cancel_of_a_loading_request_waits_for_the_load_within_the_grace(
        tiny_model, prompts, warm_pool, dp, overlap):
    """The load finishes (late, but within the grace): the request ends as cancelled, and
    its blocks were never freed under the load (check_integrity)."""
    cfg = faulty(warm_pool, {"load_polls": 200}, timeout=600, grace=30)
    with make_llm(tiny_model, cfg, dp, overlap) as llm:
        h = llm.submit(prompts[0], SP)
        h.cancel()
        out = results([h])[0]
        llm.check_integrity()
        stats = llm.stats()
    assert out.finish_reason == "cancelled" and stats["cancellations"] == 1
    assert stats["deadline_expiries"] == 0


@pytest.mark.parametrize("dp, overlap", MODES)
@pytest.mark.parametrize("abort", [True, False])
def test_cancel_expiring_the_grace(tiny_model, prompts, warm_pool, dp, overlap, abort):
    cfg = faulty(warm_pool, {"load_polls": -1}, abort=abort, timeout=600)  # never loads
    llm = make_llm(tiny_model, cfg, dp, overlap)
    h = llm.submit(prompts[0], SP)
    deadline = time.monotonic() + BOUND
    while llm.stats()["pool_hit_blocks"] == 0:  # its load is pending (admitted with its hit:
        assert time.monotonic() < deadline  # a cancel before that ends it at once)
    start = time.monotonic()
    h.cancel()
    if abort:  # aborted once the grace is over: the request ends as cancelled
        out = results([h])[0]
        assert out.finish_reason == "cancelled"
        assert GRACE <= time.monotonic() - start < BOUND  # the 600 s timeout did not matter
        llm.check_integrity()
        llm.shutdown()
    else:
        assert_fatal(llm, lambda: h.result(timeout=BOUND), "passed its deadline")
        assert time.monotonic() - start < 60  # the grace, not the 600 s timeout
        llm.shutdown()


def test_cancel_of_a_running_request_ends_it_at_once(tiny_model, prompts, tmp_path):
    with LLM(tiny_model, kv_pool=str(tmp_path), **KW) as llm:
        h = llm.submit(prompts[1], SamplingParams(max_tokens=10_000, ignore_eos=True))
        stream = h.stream()
        first = next(stream)  # it runs
        h.cancel()
        rest = list(stream)
        out = h.result(timeout=BOUND)
        llm.check_integrity()
    assert out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 10_000
    assert [first, *rest] == out.token_ids  # the stream delivered every token, once


def test_stream_yields_the_tokens_of_the_result(tiny_model, prompts, expected):
    for dp in (1, 2):
        with LLM(tiny_model, dp_size=dp, **KW) as llm:
            handles = [llm.submit(p, SP, request_id=f"r{i}") for i, p in enumerate(prompts)]
            streamed = [list(h.stream()) for h in handles]
            assert [h.request_id for h in handles] == ["r0", "r1"]
            assert streamed == [h.result().token_ids for h in handles] == expected


def test_result_timeout_and_bad_submissions(tiny_model):
    with LLM(tiny_model, **KW) as llm:
        h = llm.submit([1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        with pytest.raises(TimeoutError):
            h.result(timeout=0.01)
        with pytest.raises(ValueError, match="already in use"):
            llm.submit([1, 2], SP, request_id=h.request_id)
        with pytest.raises(ValueError, match="request_id"):
            llm.submit([1, 2], SP, request_id="")
        h.cancel()
        assert h.result(timeout=BOUND).finish_reason == "cancelled"
        bad = llm.submit([], SP).result(timeout=BOUND)  # a bad request fails alone
        assert bad.finish_reason == "error" and "empty" in bad.error


# -- shutdown ------------------------------------------------------------------------------

@pytest.mark.parametrize("dp, overlap", MODES)
def test_shutdown_drains_pending_saves(tiny_model, prompts, tmp_path, dp, overlap):
    cfg = faulty(tmp_path, {"save_polls": 30}, timeout=600, grace=30)
    llm = make_llm(tiny_model, cfg, dp, overlap)
    handles = [llm.submit(p, SamplingParams(max_tokens=10_000, ignore_eos=True))
               for p in prompts]
    next(handles[0].stream())  # running: its prompt blocks are being saved
    next(handles[1].stream())
    llm.shutdown()  # cancels both, then waits for their saves
    outs = results(handles)
    assert [o.finish_reason for o in outs] == ["cancelled", "cancelled"]
    assert len(list(pf.iter_block_files(tmp_path))) >= 10  # prompt 0's 10 full blocks, at least
    assert not list(tmp_path.rglob("*.tmp*"))


@pytest.mark.parametrize("abort", [True, False])
def test_shutdown_expiring(tiny_model, prompts, tmp_path, abort):
    cfg = faulty(tmp_path, {"save_polls": -1}, abort=abort, timeout=600)
    llm = make_llm(tiny_model, cfg, 1, True)
    h = llm.submit(prompts[0], SamplingParams(max_tokens=10_000, ignore_eos=True))
    next(h.stream())
    start = time.monotonic()
    if abort:
        llm.shutdown()
        assert h.result(timeout=BOUND).finish_reason == "cancelled"
    else:
        with pytest.raises(ConnectorError, match="passed its deadline"):
            llm.shutdown()
    assert GRACE <= time.monotonic() - start < 60


def test_freeing_blocks_under_a_pending_load_is_refused_and_fatal(tiny_model, prompts,
                                                                  warm_pool):
    from shoal.engine.connector_calls import is_kept_alive
    from shoal.request import NewRequest
    cfg = faulty(warm_pool, {"load_polls": -1}, timeout=600)
    llm = make_llm(tiny_model, cfg, 1, False)
    engine = llm.engine
    req = engine.live_requests()[engine.add(NewRequest(prompts[0], SP))]
    while not engine.transfers.is_loading(req.request_id):
        engine.step()
    blocks = list(req.block_ids)
    engine.scheduler.finish(req, "error", "ordinary cleanup")  # not through the load's end
    assert engine.failure is not None and "load is still pending" in engine.failure
    assert all(engine.kv_manager.pool.blocks[b].ref_count > 0 for b in blocks)  # still held
    with pytest.raises(ConnectorError, match="must be restarted"):
        engine.step()
    llm.shutdown()
    assert is_kept_alive(engine.kv_cache)  # never freed under a copy that may still run


def test_rank_killed_during_a_transfer(tiny_model, prompts, warm_pool):
    import os
    import signal

    from shoal.parallel.fleet import FleetError
    cfg = faulty(warm_pool, {"load_polls": -1}, timeout=600)
    llm = make_llm(tiny_model, cfg, 2, True)
    handles = [llm.submit(p, SP) for p in prompts]  # both owners are loading, forever
    os.kill(llm.engine._procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    for h in handles:
        with pytest.raises(FleetError, match="rank"):
            h.result(timeout=BOUND)
    assert time.monotonic() - start < BOUND
    llm.shutdown()
