"""The driver thread and request handles, seen from the caller's thread."""

from __future__ import annotations

import signal
import threading

import pytest

from shoal import LLM, SamplingParams
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
