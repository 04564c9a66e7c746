"""The batched sampler: the right distribution, top-k / top-p, and seeded draws that do not
depend on the batch a request lands in."""

from __future__ import annotations

import torch

import pytest

from shoal.request import Request
from shoal.logits_processing import top_k_top_p_filter
from shoal.logits_processing import gumbel_noise
from shoal.sampling import SamplingParams, Sampler

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0])


def rows(*pairs, prompt=(1, 2), stop=frozenset()) -> list[Request]:
    """Requests named and set up as the sampler sees them (one per logits row)."""
    return [Request(rid, list(prompt), sp, frozenset(stop)) for rid, sp in pairs]


def draw_frequencies(logits: torch.Tensor, n: int, seed: int = 7) -> torch.Tensor:
    noise = gumbel_noise(torch.full((n,), seed), torch.arange(n), logits.numel())
    picks = (logits.double()[None, :] + noise).argmax(-1)
    return torch.bincount(picks, minlength=logits.numel()).double() / n


def test_gumbel_max_samples_the_softmax():
    n, t = 40_000, 0.7
    freq = draw_frequencies(LOGITS / t, n)
    p = torch.softmax(LOGITS.double() / t, -1)
    bound = 4 * (p * (1 - p) / n).sqrt() + 1e-3
    assert ((freq - p).abs() <= bound).all(), (freq, p)


def test_noise_is_a_function_of_seed_draw_and_token():
    a = gumbel_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 50)
    b = gumbel_noise(torch.tensor([6, 5]), torch.tensor([0, 0]), 50)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    big = gumbel_noise(torch.tensor([-(2**63), 2**63 - 1]), torch.tensor([0, 3]), 1000)
    assert torch.isfinite(big).all()


def test_top_k_and_top_p_keep_only_their_tokens():
    rows = LOGITS.repeat(3, 1)
    out = top_k_top_p_filter(rows, [2, 0, 0], [1.0, 0.6, 1.0])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 5]  # the two largest
    p = torch.softmax(LOGITS, -1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    kept = sorted(order[before < 0.6].tolist())
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == kept
    assert torch.equal(out[2], LOGITS)  # neither: untouched


def test_seeded_draws_do_not_depend_on_the_batch():
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    greedy = SamplingParams()
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    alone, batched = Sampler(), Sampler()
    one = [alone.sample(logits[1:2], rows(("r", sp)))[0] for _ in range(20)]
    many = [batched.sample(logits, rows(("g", greedy), ("r", sp), ("x", SamplingParams(
        temperature=0.5, seed=9))))[1] for _ in range(20)]
    assert one == many and len(set(one)) > 1  # the same draws, and they do vary
    assert Sampler().sample(logits[:1], rows(("g", greedy))) == [int(logits[0].argmax())]


def reference_penalised(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                        sp: SamplingParams) -> torch.Tensor:
    """One row's logits after repetition, frequency and presence penalties and logit_bias,
    element by element as HF (repetition) and OpenAI (the others) describe them."""
    out = logits.clone()
    for t in range(out.numel()):
        n = outputs.count(t)
        if t in prompt or n:
            r = sp.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= sp.frequency_penalty * n + sp.presence_penalty * (n > 0)
    for t, b in sp.logit_bias:
        out[t] += b
    return out


def test_penalties_and_bias_follow_each_request_over_steps():
    """Greedy rows with penalties pick, step after step, the argmax of the reference's
    penalised logits (counts kept on the device as tokens are drawn); a row without any
    setting in the same batch takes the raw argmax."""
    vocab, steps = 40, 30
    g = torch.Generator().manual_seed(3)
    settings = {
        "rep": SamplingParams(max_tokens=steps, repetition_penalty=1.8),
        "freq": SamplingParams(max_tokens=steps, frequency_penalty=0.7, presence_penalty=0.3),
        "all": SamplingParams(max_tokens=steps, repetition_penalty=0.8, frequency_penalty=-0.2,
                              presence_penalty=1.5, logit_bias={3: 2.5, 7: -4.0}),
        "plain": SamplingParams(max_tokens=steps)}
    prompt = [5, 6, 9, 9]
    batch = rows(*settings.items(), prompt=prompt)
    sampler, outputs = Sampler(), {rid: [] for rid in settings}
    bias = torch.randn(vocab, generator=g) * 2  # a few tokens stay favoured: repeats happen
    for _ in range(steps):
        logits = torch.randn(len(batch), vocab, generator=g) + bias
        raw = logits.clone()
        picked = sampler.sample(logits, batch)
        assert torch.equal(logits, raw)  # the raw logits (logprobs read them) stay as they were
        for row, (rid, sp) in enumerate(settings.items()):
            want = int(reference_penalised(logits[row], prompt, outputs[rid], sp).argmax())
            assert picked[row] == want, (rid, outputs[rid])
            outputs[rid].append(picked[row])
    plain_repeats = len(outputs["plain"]) - len(set(outputs["plain"]))
    assert len(set(outputs["rep"])) > len(set(outputs["plain"])) and plain_repeats > 5


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    top = int(logits[1].argmax())
    picked = Sampler().sample(logits, rows(
        ("force", SamplingParams(temperature=1.0, logit_bias={17: 100.0})),
        ("ban", SamplingParams(logit_bias={top: -100.0}))))
    assert picked[0] == 17 and picked[1] != top
    assert picked[1] == int(logits[1].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())


def test_min_tokens_bars_stop_tokens_until_reached():
    """The stop ids (eos among them) cannot be drawn before min_tokens; then they can."""
    logits = torch.zeros(1, 10)
    logits[0, 4] = 5.0  # the eos is by far the most likely
    sp = SamplingParams(max_tokens=8, min_tokens=3)
    batch = rows(("r", sp), stop={4, 99})  # 99: a stop id outside the vocabulary is harmless
    sampler = Sampler()
    picked = [sampler.sample(logits, batch)[0] for _ in range(4)]
    assert picked[:3] == [0, 0, 0] and picked[3] == 4
    sampler.forget("r")
    assert sampler.sample(logits, batch)[0] == 0  # forgotten: a new request starts at 0


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]]))
    sampler = Sampler()
    drawn = {sampler.sample(logits, rows((f"r{i}", SamplingParams(
        temperature=1.0, min_p=0.2, seed=i))))[0] for i in range(300)}  # floor 0.2 x 0.5
    assert drawn == {0, 1, 2}


def test_token_counts_grow_and_rows_are_reused():
    """More penalised requests than the slab's first rows, forgotten and replaced: each
    row's counts start clean."""
    sampler, vocab = Sampler(), 12
    logits = torch.zeros(20, vocab)
    logits[:, 0] = 1.0
    sp = SamplingParams(frequency_penalty=2.0, max_tokens=4)
    batch = rows(*((f"a{i}", sp) for i in range(20)), prompt=[1])
    first = sampler.sample(logits, batch)
    second = sampler.sample(logits, batch)
    assert first == [0] * 20 and second == [1] * 20  # 0 then penalised: the next id (tie: 1)
    for r in batch:
        sampler.forget(r.request_id)
    again = rows(*((f"b{i}", sp) for i in range(20)), prompt=[1])
    assert sampler.sample(logits, again) == [0] * 20


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", float("nan")), ("min_p", 1.5), ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1}), ("logit_bias", "abc"), ("logit_bias", {i: 1 for i in range(301)})])
def test_out_of_range_settings_are_refused_naming_the_field(field, value):
    with pytest.raises((TypeError, ValueError), match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("option", [dict(repetition_penalty=4.0), dict(frequency_penalty=2.0),
                                    dict(presence_penalty=2.0), dict(logit_bias={0: -50.0}),
                                    dict(min_tokens=2)], ids=lambda o: next(iter(o)))
def test_each_setting_shapes_a_batch_where_no_other_row_has_one(option):
    """A step of greedy rows with no setting takes the bare argmax (the sampler's quick way);
    one setting in a batch of one row is not lost to it."""
    logits = torch.tensor([[3.0, 2.0, 0.0]])  # token 0 (in the prompt, a stop id) leads by 1
    def two_picks(sp: SamplingParams) -> list[int]:
        sampler, batch = Sampler(), rows(("r", sp), prompt=(0,), stop={0})
        return [sampler.sample(logits, batch)[0] for _ in range(2)]
    assert two_picks(SamplingParams(max_tokens=4)) == [0, 0]
    assert 1 in two_picks(SamplingParams(max_tokens=4, **option))


def test_a_step_of_plain_greedy_rows_shapes_nothing(monkeypatch):
    """Greedy rows with no setting (whatever their top-k, top-p or seed) take the argmax
    without a pass over their settings: the shaping is not even called."""
    def shape(*_):
        raise AssertionError("a plain step was shaped")
    monkeypatch.setattr(Sampler, "_shape", shape)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    batch = rows(("a", SamplingParams()), ("b", SamplingParams(top_k=3, top_p=0.5, seed=4)),
                 ("c", SamplingParams(min_p=0.2)))
    assert Sampler().sample(logits, batch) == logits.argmax(-1).tolist()
