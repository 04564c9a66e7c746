"""The driver thread and request handles, seen from the caller's thread."""

from __future__ import annotations

import signal
import threading

import pytest

from shoal import LLM, SamplingParams
from shoal.request import NewRequest
from tests.conftest import random_prompts


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler, whatever this run inherited (a background job of a
    shell starts with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_another_thread_took_interrupts_the_waiting_main_thread(tiny_model,
                                                                         ctrl_c_raises):
    """The kernel may hand a process's SIGINT to any thread; Python raises it only on the
    main thread. Here the driver thread takes it (sent to itself once the request streams):
    the main thread, waiting in `result()`, raises KeyboardInterrupt while the request is
    still running, not once it ends. Nothing is left behind: the request ends as
    cancelled."""
    sent = []

    def ctrl_c_on_this_thread(token_ids, logprobs):
        # tokens out before `subscribe` are delivered on the caller's (main) thread: skip
        if not sent and threading.current_thread() is not threading.main_thread():
            sent.append(threading.current_thread().name)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    prompt = random_prompts(512, [8], seed=3)[0]
    with LLM(tiny_model, block_size=4, num_kv_blocks=512) as llm:
        handle = llm.submit(prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
        handle.subscribe(ctrl_c_on_this_thread)
        with pytest.raises(KeyboardInterrupt):
            handle.result()
        assert not handle.done()  # raised while the request ran
        assert sent == ["shoal-driver"]
    assert handle.result().finish_reason == "cancelled"


def test_handles_submitted_without_streaming_keep_only_the_result(tiny_model):
    """`generate` submits with streams=False: the driver hands those handles no token
    batches at any step (nothing is queued for a reader that never comes), and their
    results are the same as those of streamed handles of the same prompts."""
    prompts = random_prompts(512, [5, 9, 13], seed=4)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(tiny_model, block_size=4, num_kv_blocks=512) as llm:
        quiet = llm._driver.submit([NewRequest(p, sp) for p in prompts], streams=False)
        streamed = [llm.submit(p, sp) for p in prompts]
        outs = [h.result() for h in quiet]
        assert [o.token_ids for o in outs] == [h.result().token_ids for h in streamed]
        assert [list(h.stream()) for h in streamed] == [o.token_ids for o in outs]
        assert all(not h._tokens for h in quiet)  # no batch was ever queued for them
        for h in quiet:
            with pytest.raises(RuntimeError, match="without streaming"):
                h.stream()
            with pytest.raises(RuntimeError, match="without streaming"):
                h.subscribe(lambda token_ids, logprobs: None)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("started, cycle", [(False, False), (True, False), (True, True)],
                         ids=["never-started", "driver-thread", "held-by-a-cycle"])
def test_shutdown_lets_the_engine_go(tiny_model, tmp_path, monkeypatch, started, cycle):
    """At bring-up everything alive is frozen out of the cyclic collector's reach: a
    shut-down engine that a reference cycle held kept its weights and KV memory to the end
    of the process (a GPU ran out at the fifth 8B engine of `bench ttft`). Freed at
    shutdown, though the LLM itself is still referenced: at once when no cycle holds the
    engine (none does today), else by one collection with everything thawed, after which
    the survivors are frozen again. An engine built afterwards runs."""
    import gc
    import weakref

    import shoal.driver

    collections = []
    collect = shoal.driver.collect_what_was_shut_down
    monkeypatch.setattr(shoal.driver, "collect_what_was_shut_down",
                        lambda: (collections.append(1), collect()))
    with LLM(tiny_model, num_kv_blocks=64, kv_pool=str(tmp_path)) as llm:
        if started:
            llm.generate([[5, 6, 7, 8] * 4], SamplingParams(max_tokens=3))
        engine = llm.engine
        if cycle:
            engine.runner.engine = engine
        gone = [weakref.ref(engine), weakref.ref(engine.runner.model),
                weakref.ref(engine.kv_cache)]
        del engine
    assert [ref() for ref in gone] == [None] * 3
    assert len(collections) == cycle
    assert gc.get_freeze_count() > 0  # the survivors are frozen again
    with LLM(tiny_model, num_kv_blocks=64) as again:
        assert len(again.generate([[5, 6, 7, 8] * 4], SamplingParams(max_tokens=3))[0]
                   .token_ids) == 3
