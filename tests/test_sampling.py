"""The batched sampler: the right distribution, top-k / top-p, and seeded draws that do not
depend on the batch a request lands in."""

from __future__ import annotations

import torch

from shoal.sampling import SamplingParams, Sampler, _top_k_top_p, gumbel_noise

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0])


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
    out = _top_k_top_p(rows, [2, 0, 0], [1.0, 0.6, 1.0])
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
    one = [alone.sample(logits[1:2], ["r"], [sp])[0] for _ in range(20)]
    many = [batched.sample(logits, ["g", "r", "x"], [greedy, sp, SamplingParams(
        temperature=0.5, seed=9)])[1] for _ in range(20)]
    assert one == many and len(set(one)) > 1  # the same draws, and they do vary
    assert Sampler().sample(logits[:1], ["g"], [greedy]) == [int(logits[0].argmax())]
