"""Structured output on the real SmolLM2: every output matches its constraint (checked by
independent validators: jsonschema, re), greedy and sampled, in both loops; requests
without a constraint are unchanged beside it; a constraint never makes a request fail."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from shoal import LLM, SamplingParams, StructuredOutput
from shoal.structured_output import mask_logits_

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]},
                                       "maxItems": 3}}}
ASK = [{"role": "user", "content": "Describe a famous French writer as JSON."}]


def chat(llm, sp: SamplingParams, n: int = 1, seed0: int = 0):
    sps = [sp if sp.is_greedy else SamplingParams(**{**_fields(sp), "seed": seed0 + i})
           for i in range(n)]
    return llm.chat([ASK] * n, sps)


def _fields(sp: SamplingParams) -> dict:
    return {k: getattr(sp, k) for k in sp.__dataclass_fields__}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(smollm2, temperature):
    sp = SamplingParams(max_tokens=120, temperature=temperature,
                        structured_output=StructuredOutput(json_schema=PERSON))
    outs = chat(smollm2, sp, n=1 if temperature == 0 else 6)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    if temperature:
        assert len({o.text for o in outs}) > 1  # sampled: they do differ


@pytest.mark.parametrize("spec, check", [
    (StructuredOutput(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"),
     lambda t: re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", t)),
    (StructuredOutput(choice=("Paris", "Lyon", "Nice \"the bay\"")),
     lambda t: t in ("Paris", "Lyon", 'Nice "the bay"')),
    (StructuredOutput(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutput(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'),
     lambda t: re.fullmatch(r"The answer is [0-9]+\.", t)),
    (StructuredOutput(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),  # GBNF
])
def test_each_kind_of_constraint_holds_when_sampling(smollm2, spec, check):
    sp = SamplingParams(max_tokens=200, temperature=0.7, structured_output=spec)
    for out in chat(smollm2, sp, n=4, seed0=11):
        assert out.finish_reason == "stop" and check(out.text), out.text


def test_free_requests_beside_constrained_ones_are_unchanged(smollm2):
    free = SamplingParams(max_tokens=24)
    alone = smollm2.chat([ASK], free)[0]
    mixed = smollm2.chat([ASK, ASK], [SamplingParams(max_tokens=24, structured_output=
                                                     StructuredOutput(regex="[a-z ]+")), free])
    assert mixed[1].token_ids == alone.token_ids
    assert re.fullmatch("[a-z ]+", mixed[0].text)


def test_the_overlap_loop_gives_the_same_constrained_tokens(smollm2_path, smollm2):
    """The overlap loop's constrained tokens are the plain loop's: rows leaving at different
    steps, free rows beside them, and a row that asks for logprobs."""
    sps = [SamplingParams(max_tokens=60, structured_output=StructuredOutput(json_schema=PERSON)),
           SamplingParams(max_tokens=60, temperature=0.8, seed=5,
                          structured_output=StructuredOutput(regex="[A-Z][a-z]+( [a-z]+)*\\.")),
           SamplingParams(max_tokens=9, structured_output=StructuredOutput(regex="[a-z ]+")),
           SamplingParams(max_tokens=20, temperature=0.9, seed=3)]
    with_logprobs = [sps[0], SamplingParams(max_tokens=12, logprobs=2)]
    plain = [[o.token_ids for o in smollm2.chat([ASK] * len(s), s)] for s in (sps, with_logprobs)]
    with LLM(smollm2_path, num_kv_blocks=256, overlap_scheduler=True) as overlapped:
        assert [o.token_ids for o in overlapped.chat([ASK] * 4, sps)] == plain[0]
        outs = overlapped.chat([ASK] * 2, with_logprobs)
    assert [o.token_ids for o in outs] == plain[1] and len(outs[1].logprobs) == 12


def test_masks_filled_in_the_sample_give_the_same_tokens(smollm2):
    """The masks of the next sample are started on a worker thread at the end of each
    sample (`Grammars.prepare`); a sample takes those of its rows that were in the last one
    and fills the rest (a request's first) itself. Rows leave at different steps here. The
    same tokens as with every mask filled in the sample; only each request's first mask was."""
    sps = [SamplingParams(max_tokens=40, structured_output=StructuredOutput(json_schema=PERSON)),
           SamplingParams(max_tokens=40, temperature=0.8, seed=5,
                          structured_output=StructuredOutput(regex="[A-Z][a-z]+( [a-z]+)*\\.")),
           SamplingParams(max_tokens=7, structured_output=StructuredOutput(regex="[a-z ]+")),
           SamplingParams(max_tokens=12)]
    grammars = smollm2.engine.runner.sampler.grammars
    filled_here = []
    fill = grammars._fill
    grammars._fill = lambda rows: (
        filled_here.extend(r.request_id for r in rows
                           if not threading.current_thread().name.startswith("shoal-grammar")),
        fill(rows))[1]
    try:
        ahead = [o.token_ids for o in smollm2.chat([ASK] * 4, sps)]
        assert len(filled_here) == len(set(filled_here)) == 3
        # none prepared ahead: the tokens wait for the sample's own fill
        grammars.prepare = lambda rows, tokens: setattr(
            grammars, "_unread", ([r.request_id for r in rows], tokens))
        in_the_sample = [o.token_ids for o in smollm2.chat([ASK] * 4, sps)]
    finally:
        del grammars.prepare, grammars._fill  # the class's again
    assert in_the_sample == ahead
    assert [len(t) for t in ahead[2:]] == [7, 12]


def test_a_constraint_never_fails_a_request(smollm2):
    """Too few tokens: "length", as any request. A grammar that is done: the end-of-sequence
    token is all it allows, and the request stops there."""
    short = smollm2.chat([ASK], SamplingParams(max_tokens=5, structured_output=StructuredOutput(
        json_schema=PERSON)))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    done = smollm2.chat([ASK], SamplingParams(max_tokens=30, structured_output=StructuredOutput(
        choice=("ok",))))[0]
    assert done.text == "ok" and done.finish_reason == "stop"
    assert done.token_ids[-1] in smollm2.engine.eos_token_ids


@pytest.mark.parametrize("fields, needle", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=("b",)), "exactly one"),
    (dict(regex="[a-"), "regex is not valid"),
    (dict(json_schema={"type": "nonsense"}), "json_schema is not valid"),
    (dict(json_schema="not json"), "json_schema"),
    (dict(grammar="start: undefined_rule"), "grammar is not valid"),
    (dict(choice=()), "choice"),
    (dict(choice="ab"), "choice"),
])
def test_invalid_constraints_name_the_field(fields, needle):
    with pytest.raises((TypeError, ValueError), match=needle):
        StructuredOutput(**fields)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_masking_keeps_exactly_the_allowed_tokens(kernel):
    """`mask_logits_` (Triton kernel: compiled on a GPU, else Triton's interpreter; or its
    torch ops) against bits read one by one: a vocabulary that is no multiple of 32 or of
    the kernel's tile, rows in any order, a row with no bit set and one whose only allowed
    tokens are already -inf (both: only the stop token, at 0), the other rows untouched."""
    if kernel and mask_logits_.__globals__["triton"] is None:
        pytest.skip("Triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab, words = 5003, (5003 + 31) // 32
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31, (4, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32) & torch.randint(0, 2**31, (4, words), generator=g,
                                                      dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # a dead end
    bitmask[2] = 0
    bitmask[2, 3] = 1 << 4  # token 100 only, which a bias already barred
    logits[3, 100] = float("-inf")
    rows, stops = torch.tensor([5, 0, 3, 6]), torch.tensor([2, 7, 9, 11])
    bits = (bitmask.long()[:, :, None] >> torch.arange(32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    want = logits.clone()
    for r, row in enumerate(rows.tolist()):
        want[row][~allowed[r]] = float("-inf")
        if torch.isinf(want[row]).all():
            want[row, stops[r]] = 0.0
    got = logits.to(device)
    mask_logits_(got, rows.to(device), bitmask.to(device), stops.to(device), kernel=kernel)
    assert torch.equal(got.cpu(), want)
    assert (got.cpu()[5] != float("-inf")).sum() == allowed[0].sum()  # a live row stays live


def test_a_request_is_forgotten_without_waiting_for_the_masks_being_filled(smollm2):
    """A request ends while the worker fills the masks of its last sample (in the overlap
    loop, every time): its matcher goes once the worker is done, and the forget itself does
    not wait for it (the executing thread would stall there)."""
    from types import SimpleNamespace

    from shoal.structured_output import Grammars
    from shoal.util import HostCopy
    base = smollm2.engine.runner.sampler.grammars
    grammars = Grammars(base._hf_tokenizer, base.vocab_size, base._eos)
    sp = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="[a-z ]+"))
    rows = [SimpleNamespace(request_id=f"r{i}", sampling=sp) for i in range(2)]
    grammars.masks(rows)  # (their matchers)
    gate, fill = threading.Event(), grammars._fill
    grammars._fill = lambda rows: (gate.wait(timeout=60), fill(rows))[1]  # (a hang guard)
    token = smollm2.engine.tokenizer.encode("a")[-1]
    grammars.prepare(rows, HostCopy(torch.tensor([token, token])))
    grammars.forget("r0")
    assert not gate.is_set() and set(grammars._matchers) == {"r0", "r1"}  # still filling
    gate.set()
    mask = grammars.masks(rows[1:])
    assert set(grammars._matchers) == {"r1"} and mask.shape == (1, grammars.num_words)


def test_matchers_take_a_batch_of_tokens_and_a_refused_one_ends_its_request(smollm2, caplog):
    """`advance` hands the batch to the executor's threads at once: each matcher takes its
    own token; one the grammar refuses is logged for that request only, and its next mask
    allows the end-of-sequence token alone, so the request ends there."""
    from types import SimpleNamespace

    from shoal.structured_output import Grammars, allowed_tokens
    base = smollm2.engine.runner.sampler.grammars
    grammars = Grammars(base._hf_tokenizer, base.vocab_size, base._eos)
    sp = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="[a-z]+"))
    rows = [SimpleNamespace(request_id=f"r{i}", sampling=sp) for i in range(3)]
    grammars.bitmask(rows)  # (their matchers)
    letter, digit = (smollm2.engine.tokenizer.encode(t)[-1] for t in ("a", "7"))
    with caplog.at_level("WARNING", logger="shoal.structured_output"):
        grammars.advance(["r0", "r1", "r2"], [letter, digit, letter])
    logged = [r.message for r in caplog.records if r.name == "shoal.structured_output"]
    assert len(logged) == 1 and f"of r1: token {digit} refused" in logged[0]
    allowed = allowed_tokens(grammars.bitmask(rows), grammars.vocab_size)
    assert allowed[0, letter] and allowed[2, letter] and not allowed[0, digit]
    assert allowed[1].nonzero().flatten().tolist() == grammars._eos[:1]
