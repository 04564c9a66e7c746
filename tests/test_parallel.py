"""Several ranks (tensor parallel over gloo): equality with one rank, control, failures."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shoal import LLM, SamplingParams
from shoal.parallel.fleet import FleetError
from shoal.request import NewRequest
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=16)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, [3, 9, 16, 33, 50, 1])


def single_rank(model, prompts, sampling=SP):
    with LLM(model, block_size=4, num_kv_blocks=128) as llm:
        return [o.token_ids for o in llm.generate(prompts, sampling)]


@pytest.mark.parametrize("name", ["mha_untied", "gqa_tied"])
@pytest.mark.parametrize("overlap", [False, True])
def test_tp2_equals_one_rank(tiny_models, prompts, name, overlap):
    model = str(tiny_models[name])
    expected = single_rank(model, prompts)
    with LLM(model, tp_size=2, block_size=4, num_kv_blocks=128, overlap_scheduler=overlap,
             max_num_tokens=24) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        stats = llm.stats()
        procs = list(llm.engine._procs)
    assert [o.token_ids for o in outs] == expected
    assert len(stats["per_rank"]) == 2
    for s in stats["per_rank"]:
        # one control all-gather per loop iteration, plus a broadcast when requests arrive
        assert s["control_collectives"] == s["rank_loop_iterations"] + s["control_broadcasts"]
        assert s["control_broadcasts"] >= 1 and s["iterations"] <= s["rank_loop_iterations"]
        assert s["data_collectives"] == 2 * 3 * s["forward_passes"]  # 2 all-reduces per layer
    assert [p.is_alive() for p in procs] == [False, False]  # shutdown left no process


def test_tp2_seeded_and_unseeded_sampling_agree_across_ranks(tiny_models, prompts):
    model = str(tiny_models["mha_untied"])
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=i) for i in range(6)]
    with LLM(model, tp_size=2, block_size=4, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts, seeded)
        unseeded = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.9))
    assert [o.token_ids for o in outs] == single_rank(model, prompts, seeded)
    # unseeded: the front fixes a seed, so both ranks drew the same tokens (no divergence)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in unseeded)


@pytest.mark.slow
@pytest.mark.extended  # TP of two: test_families, test_tp_pool
def test_smollm2_tp3_equals_one_rank(smollm2_path, smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three primary colors.")]
    prompts.append(tok.encode("The lighthouse keeper climbed the stairs. " * 10))
    sp = SamplingParams(max_tokens=16)
    expected = [o.token_ids for o in smollm2.generate(prompts, sp)]
    with LLM(smollm2_path, tp_size=3, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text


@pytest.mark.parametrize("mode", ["tp_size", "dp_size"])
def test_killed_rank_stops_the_fleet_within_bound(tiny_models, mode):
    llm = LLM(str(tiny_models["mha_untied"]), **{mode: 2}, block_size=4, num_kv_blocks=300)
    fleet = llm.engine
    procs = list(fleet._procs)
    rid = fleet.add(NewRequest(random_prompts(512, [8])[0],
                               SamplingParams(max_tokens=1000, ignore_eos=True)))
    assert rid not in [o.request_id for o in fleet.step().finished]  # killed mid-generation
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(FleetError, match="rank . (failed|exited).*restart is required"):
        while time.monotonic() - start < 60:
            fleet.step()
    assert time.monotonic() - start < 60
    assert [p.is_alive() for p in procs] == [False, False]
    llm.shutdown()


def test_an_engine_process_equals_the_engine_in_process(tiny_models, prompts):
    """engine_process=True: one rank in a process of its own, driven over its pipe (a
    server's Python then never holds the engine's GIL): the same tokens, greedy and seeded,
    the same stats and integrity check, streams, a cancel; no process left after."""
    model = str(tiny_models["gqa_tied"])
    seeded = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=i) for i in range(6)]
    with LLM(model, engine_process=True, block_size=4, num_kv_blocks=128) as llm:
        assert type(llm.engine).__name__ == "Fleet" and len(llm.engine._procs) == 1
        outs = llm.generate(prompts, SP)
        sampled = llm.generate(prompts, seeded)
        streamed = list(llm.submit(prompts[3], SamplingParams(max_tokens=8)).stream())
        long = llm.submit(prompts[0], SamplingParams(max_tokens=10_000, ignore_eos=True))
        long.cancel()
        assert long.result(timeout=60).finish_reason == "cancelled"
        llm.check_integrity()
        stats = llm.stats()
        procs = list(llm.engine._procs)
    assert [o.token_ids for o in outs] == single_rank(model, prompts)
    assert [o.token_ids for o in sampled] == single_rank(model, prompts, seeded)
    assert streamed == outs[3].token_ids[:8]
    assert stats["prompt_tokens"] >= sum(map(len, prompts)) and len(stats["per_rank"]) == 1
    assert [p.is_alive() for p in procs] == [False]
    with pytest.raises(ValueError, match="engine_process must be True or False"):
        LLM(model, engine_process="yes")


def test_an_engine_process_refuses_a_bad_request_and_wakes_for_the_driver(
        tiny_models, prompts, monkeypatch):
    """A request that could never run (structured output with no stop token) is a
    ValueError at the front, as in process, and the engine goes on; a step waiting for the
    rank's results returns as soon as the driver queues work (`wake`), not after its poll."""
    from concurrent.futures import ThreadPoolExecutor

    from shoal import StructuredOutput
    from shoal.parallel import fleet as fleet_module

    model = str(tiny_models["gqa_tied"])
    bad = SamplingParams(max_tokens=4, ignore_eos=True, structured_output=StructuredOutput(
        regex="[ab]+"))
    with LLM(model, engine_process=True, block_size=4, num_kv_blocks=128) as llm:
        with pytest.raises(ValueError, match="needs the model's tokenizer"):
            llm.generate(prompts[:1], bad)
        # the fleet's own check (the LLM's front checks first): the rank never sees it
        with pytest.raises(ValueError, match="needs the model's tokenizer"):
            llm._driver.call(lambda fleet: fleet.add(NewRequest(prompts[0], bad)))
        assert [o.token_ids for o in llm.generate(prompts, SP)] == single_rank(model, prompts)
        fleet = llm.engine
        monkeypatch.setattr(fleet_module, "POLL_SECONDS", 60.0)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(fleet.step)  # nothing will come back from the rank
            with pytest.raises(TimeoutError):
                waiting.result(timeout=0.2)
            start = time.monotonic()
            fleet.wake()
            assert not waiting.result(timeout=30)  # an empty result, long before 60 s
            assert time.monotonic() - start < 30
            # an idle fleet's wakes are not read: they must not fill the pipe (a write to a
            # full one would block whoever queued work, e.g. every /metrics poll)
            many = pool.submit(lambda: [fleet.wake() for _ in range(100_000)])
            many.result(timeout=30)
            assert not pool.submit(fleet.step).result(timeout=30)  # one wake waited, read here


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tp_size=0), "tp_size"), (dict(dp_size=0), "dp_size"),
    (dict(tp_size=17), "more ranks than allowed"), (dict(tp_size=3), "must divide"),
    (dict(dp_size=17), "dp_size=17 is more ranks"), (dict(dp_size=2, tp_size=2), "not supported"),
    (dict(dp_size=3), "dp_size=3 must divide the model's intermediate_size"),
])
def test_bad_parallel_config(tiny_models, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(str(tiny_models["mha_untied"]), **kwargs)


@pytest.mark.slow
@pytest.mark.extended  # torchrun of two owners runs by default
def test_torchrun_launch_of_three_local_ranks(smollm2_path, smollm2):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from shoal.parallel.fleet import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    question = "What is the capital of France?"
    r = subprocess.run([str(torchrun), "--nproc-per-node", "3", "--master-port", str(free_port()),
                        "-m", "shoal", "generate", "--model", smollm2_path, "--tp", "3", "--chat",
                        "--prompt", question, "--max-tokens", "12", "--json",
                        "--num-kv-blocks", "64"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    expected = smollm2.chat([[{"role": "user", "content": question}]],
                            SamplingParams(max_tokens=12))[0]
    assert lines[0]["token_ids"] == expected.token_ids and "Paris" in lines[0]["text"]
    summary = lines[-1]["summary"]
    assert summary["control_collectives"] == summary["iterations"] + 1  # + the final "done?"


WORKLOADS = {  # name -> (prompt lengths, max_tokens per prompt)
    "one_request_idle_owner": ([21], [16]),
    "four_equal": ([12, 12, 12, 12], [16] * 4),
    "unequal_lengths": ([3, 40, 9, 70, 1], [16] * 5),
    "one_owner_finishes_early": ([10, 11], [2, 40]),
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("overlap", [False, True])
def test_adp2_equals_one_rank(tiny_models, workload, overlap):
    model = str(tiny_models["gqa_tied"])
    lengths, max_tokens = WORKLOADS[workload]
    prompts = random_prompts(512, lengths, seed=5)
    sampling = [SamplingParams(max_tokens=n) for n in max_tokens]
    expected = single_rank(model, prompts, sampling)
    with LLM(model, dp_size=2, block_size=4, num_kv_blocks=128, overlap_scheduler=overlap,
             max_num_tokens=32) as llm:
        outs = llm.generate(prompts, sampling)
        llm.check_integrity()
        stats = llm.stats()
    assert [o.token_ids for o in outs] == expected
    for s in stats["per_rank"]:
        assert s["control_collectives"] == s["iterations"]  # exactly one per step
        assert s["kv_blocks_used"] == 0 or s["prompt_tokens"] > 0
        # every owner joined every forward: 2 gathers + 2 all-reduces... per layer (MLP)
        assert s["data_collectives"] == 2 * 3 * s["forward_passes"]
    a, b = stats["per_rank"]
    assert a["forward_passes"] == b["forward_passes"]  # no owner ever skipped a forward alone
    if workload == "one_request_idle_owner":
        idle = min(stats["per_rank"], key=lambda s: s["generated_tokens"])
        assert idle["generated_tokens"] == 0 and idle["forward_passes"] > 0
        assert idle["kv_blocks_used"] == 0  # padding allocated nothing


@pytest.mark.slow
def test_smollm2_adp2_equals_one_rank(smollm2_path, smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three primary colors.",
                         "What is 12 times 12?")]
    sp = SamplingParams(max_tokens=16)
    expected = [o.token_ids for o in smollm2.generate(prompts, sp)]
    with LLM(smollm2_path, dp_size=2, num_kv_blocks=128) as llm:
        outs = llm.generate(prompts, sp)
        per_rank = llm.stats()["per_rank"]
    assert [o.token_ids for o in outs] == expected
    assert all(s["prompt_tokens"] > 0 for s in per_rank)  # the router used both owners


def test_router_is_load_aware_with_prefix_affinity():
    from shoal.parallel.fleet import Router
    r = Router(2, block_size=4)
    a, b = [1, 2, 3, 4, 5], [9, 9, 9, 9]
    # a -> 0; b -> 1; a again: tie, affinity -> 0; a again: owner 0 busier, load wins -> 1;
    # b again: tie, affinity -> 1
    assert [r.assign(p) for p in (a, b, a + [6], a + [7], b + [1])] == [0, 1, 0, 1, 1]
    assert r.load == [2, 3]
    r.release(1)
    r.release(1)
    assert r.assign([5, 5]) == 1  # shorter than a block: no affinity, least loaded


def test_router_remembers_a_bounded_number_of_first_blocks(monkeypatch):
    from shoal.parallel import router
    monkeypatch.setattr(router, "MAX_AFFINITY_KEYS", 2)
    r = router.Router(2, block_size=2)

    def to_owner_1(prompt):  # owner 0 is busy (a prompt shorter than a block), then free
        r.assign([9])
        assert r.assign(prompt) == 1
        r.release(0)
        r.release(1)

    def on_a_tie(prompt) -> int:  # the remembered owner, else the lowest rank
        owner = r.assign(prompt)
        r.release(owner)
        return owner

    a, b, c = [1, 1], [2, 2], [3, 3]
    to_owner_1(a)
    to_owner_1(b)
    assert on_a_tie(a) == 1  # remembered; now b is the least recently routed
    to_owner_1(c)  # b is forgotten to make room
    assert on_a_tie(b) == 0  # (and a is forgotten for b)
    assert on_a_tie(c) == 1 and on_a_tie(a) == 0


@pytest.mark.slow
def test_torchrun_launch_of_two_adp_owners(smollm2_path, smollm2):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from shoal.parallel.fleet import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?"]
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
                        "-m", "shoal", "generate", "--model", smollm2_path, "--dp", "2", "--chat",
                        *[a for q in questions for a in ("--prompt", q)], "--max-tokens", "12",
                        "--json", "--num-kv-blocks", "64"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    expected = smollm2.chat([[{"role": "user", "content": q}] for q in questions],
                            SamplingParams(max_tokens=12))
    assert [x["token_ids"] for x in lines[:-1]] == [o.token_ids for o in expected]
    assert lines[-1]["summary"]["control_collectives"] == lines[-1]["summary"]["iterations"] + 1
