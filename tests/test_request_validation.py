"""A bad request fails at the call (or alone), never the engine: one rank and an ADP fleet."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import LLM, SamplingParams
from shoal.structured_output import StructuredOutput
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=24, ignore_eos=True)
VOCAB = 512  # the tiny models' vocabulary

BAD_GENERATE = [  # (prompts, kwargs, exception, what the message names)
    ([[1, 2, VOCAB]], {}, ValueError, "vocabulary"),
    ([[1, -1, 3]], {}, ValueError, "vocabulary"),
    ([[1, 2**70]], {}, ValueError, "vocabulary"),
    ([["a", "b"]], {}, TypeError, "token ids must be ints"),
    ([[1.0, 2.0]], {}, TypeError, "token ids must be ints"),
    ([[1, True]], {}, TypeError, "token ids must be ints"),
    ({"prompt": [1, 2]}, {}, TypeError, "prompts must be"),
    (b"abc", {}, TypeError, "prompts must be"),
    ([b"abc"], {}, TypeError, "got bytes"),
    (None, {}, TypeError, "prompts must be"),
    ([np.zeros((2, 2), dtype=np.int64)], {}, TypeError, "got ndarray"),
    ([[1, 2, 3]], {"cache_salt": 5}, TypeError, "cache_salt"),
    ([[1, 2, 3]], {"sampling": "greedy"}, TypeError, "sampling"),
    ([[1, 2, 3]], {"sampling": [SP, SP]}, ValueError, "sampling"),
    ([[1, 2, 3]], {"sampling": [object()]}, TypeError, "sampling"),
    ([[1, 2, 3], [1, 2, VOCAB + 7]], {}, ValueError, "vocabulary"),  # all or nothing
    ([[1, 2, 3]], {"sampling": SamplingParams(logit_bias={VOCAB: 1.0})}, ValueError, "logit_bias"),
    # the tiny checkpoints have no tokenizer: nothing to match a grammar against
    ([[1, 2, 3]], {"sampling": SamplingParams(structured_output=StructuredOutput(regex="a+"))},
     ValueError, "tokenizer"),
]

BAD_SAMPLING = [
    (dict(seed=2**70), ValueError, "seed"), (dict(seed=-(2**64)), ValueError, "seed"),
    (dict(seed="7"), TypeError, "seed"), (dict(seed=1.5), TypeError, "seed"),
    (dict(max_tokens=True), TypeError, "max_tokens"), (dict(max_tokens=2.0), TypeError, "max_tokens"),
    (dict(temperature="hot"), ValueError, "temperature"), (dict(top_p=float("nan")), ValueError, "top_p"),
    (dict(top_k=1.5), TypeError, "top_k"), (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids"), (dict(ignore_eos=1), TypeError, "ignore_eos"),
]


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(VOCAB, [11], seed=9)[0]


@pytest.fixture(scope="module")
def clean(tiny_model, prompt):
    with LLM(tiny_model, block_size=4, num_kv_blocks=128) as llm:
        return llm.generate([prompt], SP)[0].token_ids


@pytest.fixture(scope="module", params=[1, 2], ids=["one_rank", "adp2"])
def llm(request, tiny_model):
    with LLM(tiny_model, dp_size=request.param, block_size=4, num_kv_blocks=128) as llm:
        yield llm


def test_bad_generate_fails_at_the_call_and_loses_nothing(llm, prompt, clean):
    before = llm.stats()["prompt_tokens"]
    good = llm.submit(prompt, SP)  # running while every bad call is made
    for prompts, kwargs, error, needle in BAD_GENERATE:
        with pytest.raises(error, match=needle):
            llm.generate(prompts, **kwargs)
    assert good.result(timeout=120).token_ids == clean
    llm.check_integrity()
    stats = llm.stats()
    assert stats["prompt_tokens"] - before == len(prompt)  # nothing of the bad calls was added
    assert llm.generate([prompt], SP)[0].token_ids == clean  # the engine goes on


def test_bad_submit_and_chat_fail_at_the_call(llm, prompt, clean):
    good = llm.submit(prompt, SP)
    for kwargs, error, needle in [(dict(request_id=""), ValueError, "request_id"),
                                  (dict(request_id=7), ValueError, "request_id"),
                                  (dict(sampling=dict(max_tokens=3)), TypeError, "sampling"),
                                  (dict(cache_salt=b"x"), TypeError, "cache_salt")]:
        with pytest.raises(error, match=needle):
            llm.submit(prompt, **kwargs)
    with pytest.raises(ValueError, match="already in use"):
        llm.submit(prompt, SP, request_id=good.request_id)
    for messages in ([{"role": "user"}], [{"role": "user", "content": 5}], ["hi"], [[]], 3):
        with pytest.raises(TypeError, match="message|conversation"):
            llm.chat(messages)
    assert good.result(timeout=120).token_ids == clean
    llm.check_integrity()


@pytest.mark.parametrize("kwargs, error, needle", BAD_SAMPLING)
def test_bad_sampling_values_name_the_field(kwargs, error, needle):
    with pytest.raises(error, match=needle):
        SamplingParams(**kwargs)


def test_token_ids_as_arrays_equal_lists(llm, prompt, clean):
    outs = llm.generate([np.array(prompt), tuple(np.int32(t) for t in prompt)], SP)
    assert [o.token_ids for o in outs] == [clean, clean]
    assert llm.generate(np.array(prompt, dtype=np.int64), SP)[0].token_ids == clean
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1  # the largest seed is accepted


def test_a_request_that_cannot_be_prepared_fails_alone(tiny_model, prompt, clean, monkeypatch):
    with LLM(tiny_model, block_size=4, num_kv_blocks=128) as llm:
        kv = llm.engine.kv_manager
        real = kv.update_block_keys

        def broken(req):
            if req.prompt_token_ids[0] == 3:
                raise RuntimeError("cannot hash this one")
            return real(req)

        monkeypatch.setattr(kv, "update_block_keys", broken)
        outs = llm.generate([prompt, [3, 4, 5, 6, 7]], SP)
        assert outs[0].token_ids == clean
        assert outs[1].finish_reason == "error" and "could not be prepared" in outs[1].error
        llm.check_integrity()
        assert llm.generate([prompt], SP)[0].token_ids == clean
