"""The compute-or-load decision (shoal.engine.load_split): pure functions of measured rates."""

from __future__ import annotations

import json

import pytest

from shoal.engine.load_split import MIN_SPLIT_GAIN, LoadPlanner
from shoal.engine.rates_file import PREFILL_UNIT, restore_rates, save_rates

BS = 16


def planner(prefill=None, load=None, latency=0.0, max_num_tokens=8192) -> LoadPlanner:
    p = LoadPlanner(BS, max_num_tokens)
    p.prefill_tps.value, p.load_tps.value = prefill, load
    p.load_latency_s.value = latency if load is not None else None
    return p


def test_unknown_rates_load_it_all_and_the_front_waits():
    for p in (planner(), planner(prefill=1000.0)):
        d = p.admit(0, 64)
        assert d.load_from == 0 and d.first.num_tokens == 0


def test_a_store_slower_than_computing_is_not_loaded_at_all():
    # 1% of the rate at which loading would take as long as computing
    d = planner(prefill=10_000.0, load=100.0).admit(4, 68)
    assert d.load_from == 68 and d.first is None
    # a fixed latency longer than computing it all is the break-even size at work
    d = planner(prefill=10_000.0, load=1e9, latency=0.2).admit(0, 64)  # 1024 tokens: 0.1 s
    assert d.load_from == 64


def test_a_split_that_saves_less_than_a_forward_is_computed():
    """A load at 1% of the prefill rate could take the hit's last block (they would end
    together), but a hit that loads needs one more forward after it (the prompt's rest),
    which computing the hit with the rest does not: saving 16 ms of a 2 s hit does not pay
    a 50 ms forward."""
    p = planner(prefill=1000.0, load=10.0)
    p.prefill_overhead_s = 0.05
    assert p.front_step(0, 127, 127, None, 0.0).drop_to < 127  # the bare split
    d = p.admit(0, 127)
    assert d.load_from == 127 and d.first is None
    q = planner(prefill=1000.0, load=1000.0)  # a load as fast as computing: it pays
    q.prefill_overhead_s = 0.05
    assert q.admit(0, 127).load_from < 127
    # also when a step's budget takes less than the front's share at once (the split: 1104
    # tokens computed, 2 steps' worth; the rest loaded at 800/s: both end after ~1.2 s)
    r = planner(prefill=1000.0, load=800.0, max_num_tokens=256)
    r.prefill_overhead_s = 0.05
    d = r.admit(0, 127)
    assert d.load_from < 127 and d.first.num_tokens == 256


def test_a_split_that_ends_only_a_little_sooner_loads_it_all():
    """On a GPU a front beside a load runs slower than the model says: an 8B hit of 8k
    tokens from host memory (rates as measured on an H100) that a 768-token front would end
    7% sooner is loaded whole (it ran 15-30% later split); a slower store's split still
    pays."""
    p = planner(prefill=35_500.0, load=348_000.0)
    p.min_gain = LoadPlanner(BS, 2048, device="cuda").min_gain  # a GPU's
    assert p.min_gain == MIN_SPLIT_GAIN
    assert p.admit(0, 508).first.num_tokens == 0
    p.load_tps.value = 130_000.0
    assert p.admit(0, 508).first.num_tokens > 0
    # on a CPU splits run as modelled: any gain is taken
    q = planner(prefill=35_500.0, load=348_000.0)
    assert q.min_gain == 0 and q.admit(0, 508).first.num_tokens > 0


def test_a_front_measured_slow_beside_its_load_makes_the_next_hits_load_whole():
    """On an H100 an 8k 1B hit from host memory was split into a 1,216-token front
    expected to take its 5.7 ms of launches; beside the load it took 10-16 ms, later than
    loading it all. The front's step teaches the slowdown: the next hits load whole. Each
    hit loaded whole takes a share of it away, so a split is tried again some hits later
    (a slowdown that went away is measured anew, not kept forever)."""
    p = planner(prefill=217_000.0, load=1_150_000.0)
    p.prefill_launch_s, p.min_gain = 0.0057, MIN_SPLIT_GAIN
    first = p.admit(0, 508).first.num_tokens
    assert 1000 < first < 1400  # the split the H100 run made
    p.observe_front([(0, first)], 0.0163)  # averaged from 1 (no slowdown): one step is half
    assert p.front_slowdown.value == pytest.approx(
        (1 + 0.0163 / max(0.0057, first / 217_000)) / 2)
    hits = 0
    while p.admit(0, 508).first.num_tokens == 0:
        hits += 1
        assert hits < 100
    assert 10 <= hits <= 60
    # a hit computed (a slowdown that makes a front dearer than computing it all) takes its
    # share away too: a slow store's split is tried again, not left to the slowdown forever
    r = planner(prefill=217_000.0, load=150_000.0)
    r.prefill_launch_s, r.min_gain = 0.0057, MIN_SPLIT_GAIN
    assert r.admit(0, 508).first.num_tokens > 0
    r.front_slowdown.value = 8.0
    assert r.admit(0, 508).first is None  # computed
    hits = 1
    while (d := r.admit(0, 508)).first is None or d.first.num_tokens == 0:
        hits += 1
        assert hits < 100
    assert r.front_slowdown.value < 8.0
    # a front no slower than the model says teaches nothing slower than 1
    q = planner(prefill=217_000.0, load=1_150_000.0)
    q.observe_front([(0, 4096)], 0.001)
    assert q.front_slowdown.value == 1.0
    q.observe_front([(0, 4096)], 100.0)  # an outlier (a stall) counts at most 8x
    assert q.front_slowdown.value <= 8.0


def test_a_split_s_load_teaches_its_slowdown_beside_the_front_not_the_store_s_rate():
    """On an H100 a 1B hit of 8k tokens from files split 4,992 / 3,200: its load ran at 214k
    tokens/s beside the front against 340k alone, and its front ran 1.74x its estimate.
    Taught as the store's rate, the slow load made loading whole look slower, and every
    next hit split again (0.81 of the recompute against 0.67 loaded whole). A split's load
    teaches how much longer it takes beside a front; the store's rate stays what loads
    alone measured, and after a split or two the hits load whole."""
    p = planner(prefill=164_000.0, load=340_000.0)
    p.min_gain = MIN_SPLIT_GAIN
    splits = 0
    while (d := p.admit(0, 512)).first.num_tokens:  # split, as the H100 run did
        splits += 1
        assert splits < 10, "splits forever"
        front = d.first.num_tokens
        p.observe_front([(0, front)], 1.74 * front / 164_000.0)
        num_loaded = (512 - d.load_from) * BS
        p.observe_load(num_loaded, num_loaded / 214_000.0, None, split=True)
        assert p.load_tps.value == 340_000.0  # the store's rate: as loads alone measured it
    assert 1 <= splits <= 3 and d.load_from == 0  # then loaded whole
    assert 1.2 < p.load_slowdown.value < 340 / 214  # (a hit loaded whole takes a share away)
    p.load_slowdown.value = None
    num_loaded = 3200
    # a load planned whole that the front overtook teaches the store's rate, as before
    p.observe_load(num_loaded, num_loaded / 100_000.0, None)
    assert p.load_tps.value == pytest.approx((340_000.0 + 100_000.0) / 2)
    # a split's load faster than loads alone: no slowdown below 1, and the store is at least
    # that fast alone (else a rate once too low, every hit split, would never be corrected)
    q = planner(prefill=164_000.0, load=214_000.0)
    q.observe_load(4096, 4096 / 340_000.0, None, split=True)
    assert q.load_slowdown.value == 1.0
    assert q.load_tps.value == pytest.approx((214_000.0 + 340_000.0) / 2)
    # one that landed nothing beside its front bounds the rate alone at g blocks in its time
    q.load_slowdown.value = 2.0
    q.observe_load(0, 0.01, None, split=True)
    assert q.load_tps.value == pytest.approx(2.0 * BS / 0.01)
    # one never measured alone teaches the store's rate (nothing to weigh it against)
    r = planner(prefill=164_000.0)
    r.observe_load(4096, 4096 / 214_000.0, None, split=True)
    assert r.load_tps.value == pytest.approx(214_000.0) and r.load_slowdown.value is None


def test_a_step_teaches_the_prefill_rate_alone_and_the_front_s_slowdown_beside_a_load():
    from types import SimpleNamespace as NS

    def batch(chunks, loading=()):
        chunks = [NS(start=s, num_tokens=n, request=NS(request_id=rid)) for s, n, rid in chunks]
        return NS(chunks=chunks, num_tokens=sum(c.num_tokens for c in chunks),
                  transfers=NS(loading_ids=tuple(loading)))

    p = planner(prefill=100_000.0)
    p.observe_step(batch([(0, 1000, "a")]), 0.005)  # no load pending: the prefill rate
    assert p.prefill_tps.value == pytest.approx(150_000.0) and p.front_slowdown.value is None
    p.observe_step(batch([(0, 1500, "a"), (9, 1, "b")], loading=["a"]), 0.02)  # a's front
    assert p.prefill_tps.value == pytest.approx(150_000.0)
    assert p.front_slowdown.value == pytest.approx((1 + 0.02 / (1501 / 150_000.0)) / 2)
    slowdown = p.front_slowdown.value
    # decodes, or another request's chunk while a load is pending: neither
    p.observe_step(batch([(100 + i, 1, str(i)) for i in range(64)]), 0.005)
    p.observe_step(batch([(0, 1000, "c")], loading=["a"]), 0.5)
    assert p.prefill_tps.value == pytest.approx(150_000.0)
    assert p.front_slowdown.value == slowdown


def test_a_store_much_faster_than_computing_loads_everything():
    d = planner(prefill=300.0, load=150_000.0, latency=0.001).admit(2, 130)
    assert d.load_from == 2 and d.first.num_tokens == 0  # not one block could be computed first


def test_equal_rates_split_in_the_middle_and_the_front_starts_at_once():
    p = planner(prefill=100_000.0, load=100_000.0)
    d = p.admit(0, 512)  # 8192 tokens: they meet after 41 ms, half of it each
    assert d.load_from == 256  # n * C / (C + L): the load starts at the meeting point
    assert d.first.num_tokens == 4096  # the front's share, in one forward


def test_a_forward_s_fixed_cost_moves_the_split_towards_the_load():
    p = planner(prefill=100_000.0, load=100_000.0)
    p.prefill_overhead_s = 0.01  # 1000 tokens' worth
    d = p.admit(0, 512)
    # the front gives up half of it (the exact share is 3596 tokens: the nearer boundary)
    assert d.load_from == 225
    p.prefill_overhead_s = 0.05  # a forward costs more than the load of its share saves
    assert p.admit(0, 512).first.num_tokens == 0


def test_a_front_whose_launches_outlast_the_load_waits_for_it():
    """On a GPU no eager forward takes less than its launches. An 8k-token 1B hit from host
    memory (rates as measured on an H100) loads whole in less time than a front's launches
    take, so it is loaded whole; in a linear model (no launch floor) it was split into a
    1,300-token front, which ran 16 ms longer than loading it all. A slower load (the
    files') still splits, and the front's share is one the launches do not outlast."""
    def p(load, launch):
        q = planner(prefill=220_000.0, load=load, latency=0.0005)
        q.prefill_launch_s = launch
        return q
    assert p(1_300_000.0, 0.0).admit(0, 512).first.num_tokens > 0  # a linear model splits
    d = p(1_300_000.0, 0.008).admit(0, 512)
    assert d.load_from == 0 and d.first.num_tokens == 0
    d = p(150_000.0, 0.008).admit(0, 512)
    assert 0 < d.load_from < 512 and d.first.num_tokens / 220_000 > 0.008
    # what the bring-up measured, and a launch longer than the large forward is capped
    q = planner()
    q.calibrate_prefill((512, 0.0125), (2048, 0.0225), launch_s=0.012)
    assert q.prefill_launch_s == 0.012
    assert q.compute_seconds(0, 16) == 0.012  # a short forward: its launches
    assert q.compute_seconds(0, 4096) == pytest.approx(0.0125 + 3584 / 153_600)
    q.calibrate_prefill((512, 0.0125), (2048, 0.0225), launch_s=1.0)
    assert q.prefill_launch_s == 0.0225


def test_a_step_that_is_mostly_its_launches_does_not_teach_the_rate():
    """On a GPU an eager step of a few dozen tokens takes about its launches: its time says
    nothing of the prefill rate (one such step would halve it); a long step still counts."""
    p = planner(prefill=220_000.0)
    p.prefill_launch_s = 0.008
    p.observe_prefill([(0, 40), (3000, 1), (5000, 1)], 0.0095)
    assert p.prefill_tps.value == 220_000.0
    p.observe_prefill([(0, 8192)], 8192 / 160_000)
    assert p.prefill_tps.value == pytest.approx((220_000 + 160_000) / 2)


def test_the_load_s_own_rate_overrides_earlier_loads():
    p = planner(prefill=1000.0, load=1e9)
    # 10 s in, only 16 of 1024 tokens landed: this load is dead slow, compute the rest
    step = p.front_step(0, 63, 64, started=0.0, now=10.0)
    assert step.num_tokens == min(63 * BS, 8192) and step.drop_to == 63


def test_a_few_first_blocks_do_not_replace_earlier_loads_rate():
    """Earlier loads ran at 77k tokens/s; 3 blocks landed 2 ms into this one (24k tokens/s
    while the reads ramp up). Not yet this load's rate: the front takes the share the
    earlier rate gives it (n C / (C + L), ~400 tokens; at 24k it would take ~900). Far
    slower (4x) counts at once."""
    p = planner(prefill=20_000.0, load=77_000.0)
    step = p.front_step(0, 124, 127, started=0.0, now=0.002)
    assert 1984 * 20 // 97 - BS <= step.num_tokens <= 1984 * 20 // 97 + BS, step
    p = planner(prefill=635.0, load=77_000.0)
    slow = p.front_step(0, 124, 127, started=0.0, now=0.3)  # 160 tokens/s: its share
    assert slow.num_tokens == 1984 * 635 // (635 + 160) // BS * BS and slow.drop_to == 99


def test_a_fast_load_ramping_up_is_not_taken_for_slow():
    """Seen on CPU: earlier loads 72.7k tokens/s after 2.7 ms; this one has landed 2 blocks
    6 ms in (9k tokens/s counted from when they were due, over 4x slower). Taken for its
    rate, the front computed 144 tokens in a forward of 0.28 s while the load landed the
    rest in 27 ms more (TTFT 0.32 s against 0.14 s loaded whole). Ramping up, not slow: the
    earlier rate holds until it would have landed 8 blocks 4 times over."""
    p = planner(prefill=1320.0, load=72_700.0, latency=0.00265)
    p.prefill_overhead_s = 0.08
    assert p.front_step(0, 125, 127, started=0.0, now=0.006).num_tokens == 0
    # still 2 blocks at 30 ms: that is slow
    assert p.front_step(0, 125, 127, started=0.0, now=0.03).num_tokens > 0


def test_a_front_whose_forward_still_runs_plans_its_next_share_after_it():
    """The overlap loop schedules the next step while the front's forward runs: the next
    share computes after it, so no more is planned where the load ends with it (a share
    planned as if the forward had ended grew the 8B front from ~3,400 to 4,416 tokens)."""
    p = planner(prefill=50_000.0, load=90_000.0)
    first = p.admit(0, 512).first  # 8192 tokens: ~2,900 computed, the rest loaded
    assert 2600 <= first.num_tokens <= 3200, first
    front = first.num_tokens
    busy = p.compute_seconds(0, front)  # just launched
    still = p.front_step(front, 512, 512, started=0.0, now=0.001, busy=busy)
    assert still.num_tokens == 0 and still.drop_to == 0, still
    # the same step as if the forward were done takes a share of what the load has left
    assert p.front_step(front, 512, 512, started=0.0, now=0.001).num_tokens > 0


def test_the_first_landed_unit_is_not_taken_for_the_rate():
    """A store with 50 ms to its first blocks and fast after: 16 blocks landed 60 ms in.
    Over the whole wait that is ~4,300 tokens/s, slower than computing (5,000): the front
    would take most of the rest. Counted from when blocks were due (the latency of earlier
    loads) it is ~26,000: the load keeps the back. A load that is really slow still loses
    it."""
    p = planner(prefill=5000.0, load=100_000.0, latency=0.05)
    fast = p.front_step(0, 48, 64, started=0.0, now=0.06)
    assert fast.drop_to <= 16, fast  # at most a third of what is left is computed
    slow = p.front_step(0, 48, 64, started=0.0, now=4.0)  # 256 tokens in 4 s: slow
    assert slow.drop_to == 48, slow


def test_no_word_from_a_first_load_is_waited_for_only_so_long():
    p = planner(prefill=1000.0)  # computing the 1024 tokens takes 1.024 s: 5% of it, 51 ms
    assert p.front_step(0, 64, 64, started=0.0, now=0.05).num_tokens == 0
    step = p.front_step(0, 64, 64, started=0.0, now=0.052)
    assert step.num_tokens == 1024 and step.drop_to == 64


def test_a_load_waiting_its_turn_is_not_taken_for_slow():
    """A load whose turn has not come (started None: the loads before it still bring in
    their blocks) has landed nothing however long it waits: with no rate known its front
    waits for the turn; with one known, the tokens ahead are its latency."""
    p = planner(prefill=1000.0)
    assert p.front_step(0, 64, 64, started=None, now=10.0, ahead=8192).num_tokens == 0
    q = planner(prefill=100_000.0, load=100_000.0)
    alone = q.admit(0, 512)
    assert q.front_step(0, 512, 512, None, 0.0, ahead=0) == alone.first
    behind = q.admit(0, 512, ahead=4096)  # 41 ms before it starts: the front takes more
    assert behind.first.num_tokens > alone.first.num_tokens and behind.load_from > 256
    assert q.admit(0, 512, ahead=10 ** 6).load_from == 512  # 10 s behind: computed


def test_a_load_that_landed_nothing_bounds_an_unknown_rate():
    p = planner(prefill=1000.0)
    p.observe_load(0, 0.5, None)  # not a block in 0.5 s: at most 32 tokens/s
    assert p.load_tps.value == BS / 0.5
    p.observe_load(0, 0.1, None)  # a looser bound changes nothing
    assert p.load_tps.value == BS / 0.5
    p.observe_load(0, 2.0, None)  # a tighter one lowers it
    assert p.load_tps.value == BS / 2.0
    assert p.admit(0, 64).load_from == 64  # the next hit computes it all


def test_a_load_overdue_is_taken_for_slow():
    """Earlier loads said 1000 tokens/s, 10 ms to the first block; this one has landed
    nothing of its 1024 tokens after 1 s (it may land all at once: that is all the silence
    says), later after 100 s: at most 10 tokens/s, so the front computes the rest."""
    p = planner(prefill=1000.0, load=1000.0, latency=0.01)
    assert p.front_step(0, 64, 64, started=0.0, now=0.005).num_tokens < 1024
    assert p.front_step(0, 64, 64, started=0.0, now=1.0).num_tokens < 1024
    step = p.front_step(0, 64, 64, started=0.0, now=100.0)
    assert step.num_tokens == 1024 and step.drop_to == 64


def test_the_front_never_passes_the_landed_blocks():
    p = planner(prefill=1e6, load=10.0)
    step = p.front_step(40 * BS, 50, 64, started=0.0, now=1.0)
    assert step.num_tokens <= 10 * BS and step.drop_to <= 50
    assert p.front_step(50 * BS, 50, 64, started=0.0, now=1.0).num_tokens == 0


def test_measurements_move_the_rates():
    p = planner()
    p.observe_prefill([(0, 8)], 1.0)  # too small a step to say anything
    assert p.prefill_tps.value is None
    p.observe_prefill([(0, 600), (40, 400)], 0.5)
    assert p.prefill_tps.value == 2000.0
    p.observe_load(1024, 1.0, first_landed_s=0.2)
    assert p.load_latency_s.value == pytest.approx(0.2)
    assert p.load_tps.value == pytest.approx(1024 / 0.8)


def test_a_load_that_lands_all_at_once_has_no_first_block_latency():
    """The tier's blocks are one unit: its first block lands with the last. The whole time
    is the rate (were it latency, a smaller load would be predicted as slow as this one)."""
    p = planner()
    p.observe_load(1024, 0.01, first_landed_s=0.01, host_share=1.0)
    assert p.host_load_tps.value == pytest.approx(1024 / 0.01)
    assert p.host_load_latency_s.value is None
    p.observe_load(1024, 1.0, first_landed_s=None)  # finished before any poll saw a block
    assert p.load_tps.value == pytest.approx(1024.0) and p.load_latency_s.value is None


def test_each_load_teaches_the_rate_of_its_source():
    p = planner()
    p.observe_load(1024, 1.0, first_landed_s=0.0, host_share=1.0)  # all from host memory
    assert p.host_load_tps.value == 1024.0 and p.load_tps.value is None
    p.observe_load(512, 1.0, first_landed_s=0.0, host_share=0.0)  # all from the store
    assert p.load_tps.value == 512.0 and p.host_load_tps.value == 1024.0
    # half and half in 1.5 s: the host half took 0.5 s at its known rate, the store's 1 s
    q = planner()
    q.host_load_tps.value = 1024.0
    q.observe_load(1024, 1.5, first_landed_s=0.0, host_share=0.5)
    assert q.load_tps.value == pytest.approx(512.0) and q.host_load_tps.value == 1024.0
    # the other way round: the store's rate known, the host's learnt
    r = planner(load=512.0)
    r.observe_load(1024, 1.5, first_landed_s=0.0, host_share=0.5)
    assert r.host_load_tps.value == pytest.approx(1024.0) and r.load_tps.value == 512.0
    planner().observe_load(1024, 1.5, first_landed_s=0.0, host_share=0.5)  # neither: nothing


def test_a_hit_weighs_the_two_load_rates_by_its_share_of_each():
    p = planner(prefill=10_000.0, load=100.0)  # the store is far slower than computing
    p.host_load_tps.value, p.host_load_latency_s.value = 1e6, 0.0  # host memory far faster
    assert p.admit(0, 64).load_from == 64  # from the store: computed
    d = p.admit(0, 64, host_share=1.0)  # from host memory: loaded, the front waits
    assert d.load_from == 0 and d.first.num_tokens == 0
    assert p.expected_rate(0.5) == pytest.approx((1 / (0.5 / 1e6 + 0.5 / 100.0), 0.0))
    # half from the store: L = 200/s, the load takes n * L / (C + L) = 20 tokens' worth: of
    # 1 and 2 blocks, the one where both end sooner (2 blocks' load alone takes 0.16 s)
    assert p.admit(0, 64, host_share=0.5).load_from == 63
    q = planner(prefill=10_000.0, load=100.0)  # host memory not measured yet: as the store
    assert q.expected_rate(1.0) == (100.0, 0.0) and q.admit(0, 64, host_share=1.0).load_from == 64


def test_rates_are_kept_for_the_next_run(tmp_path):
    path = tmp_path / "rates" / "x.json"
    p = planner(prefill=123.0, load=456.0, latency=0.5)
    p.prefill_overhead_s = 0.01
    p.prefill_launch_s = 0.02
    p.host_load_tps.value, p.host_load_latency_s.value = 789.0, 0.25
    p.front_slowdown.value, p.load_slowdown.value = 2.5, 1.5
    save_rates(p, path)
    q = planner()
    restore_rates(q, path)
    assert (q.prefill_tps.value, q.load_tps.value, q.load_latency_s.value) == (123.0, 456.0, 0.5)
    assert (q.host_load_tps.value, q.host_load_latency_s.value) == (789.0, 0.25)
    assert q.prefill_overhead_s == 0.01 and q.prefill_launch_s == 0.02
    assert q.front_slowdown.value == 2.5 and q.load_slowdown.value == 1.5
    for saved, restored in ((100.0, 8.0), (0.5, 1.0)):  # a ratio: kept within [1, 8]
        path.write_text(json.dumps({"front_slowdown": saved, "load_slowdown": saved}))
        r = planner()
        restore_rates(r, path)
        assert r.front_slowdown.value == r.load_slowdown.value == restored
    # a file from before the prefill rate was counted in work: its load rates only
    path.write_text(json.dumps({"prefill_tps": 123.0, "prefill_overhead_s": 0.01,
                                "load_tps": 456.0, "load_slowdown": None}))
    old = planner()
    restore_rates(old, path)
    assert old.prefill_tps.value is None and old.prefill_overhead_s == 0.0
    assert old.load_tps.value == 456.0
    # one from before a split's load stopped teaching the load rates (a slowed rate): its
    # prefill rate only
    path.write_text(json.dumps({"prefill_tps": 123.0, "prefill_unit": PREFILL_UNIT,
                                "load_tps": 214.0, "host_load_tps": 1.0}))
    older = planner()
    restore_rates(older, path)
    assert older.prefill_tps.value == 123.0
    assert older.load_tps.value is None and older.host_load_tps.value is None
    path.write_text(json.dumps({"prefill_tps": "fast", "load_tps": True}))  # garbage: ignored
    r = planner()
    restore_rates(r, path)
    assert r.prefill_tps.value is None and r.load_tps.value is None
    path.write_text("{not json")
    restore_rates(planner(), path)  # no error
    save_rates(planner(), tmp_path / "rates" / "empty.json")  # nothing measured: nothing written
    assert not (tmp_path / "rates" / "empty.json").exists()


def test_two_forwards_give_the_rate_and_the_fixed_cost():
    p = planner()
    # 512 tokens in 12.5 ms, 2048 in 22.5 ms: 153.6k tokens/s past a 9.2 ms fixed cost
    p.calibrate_prefill((512, 0.0125), (2048, 0.0225))
    assert p.prefill_tps.value == pytest.approx(153_600)
    assert p.prefill_overhead_s == pytest.approx(0.0125 - 512 / 153_600)
    p.observe_prefill([(0, 4096)], 0.0125 - 512 / 153_600 + 4096 / 153_600)  # the same line
    assert p.prefill_tps.value == pytest.approx(153_600)


def test_a_noisy_bring_up_pair_changes_nothing():
    p = planner(prefill=5000.0)
    p.prefill_launch_s = 0.01
    p.calibrate_prefill((32, 0.95), (128, 0.25), launch_s=0.2)  # the small one was slow
    assert p.prefill_tps.value == 5000.0 and p.prefill_overhead_s == 0.0
    assert p.prefill_launch_s == 0.01
    p.calibrate_prefill((32, 0.10), (128, 0.11))  # the fixed cost is capped at half the large
    assert p.prefill_overhead_s <= 0.055


def test_a_long_front_costs_more_per_token_than_a_short_one():
    """With attention's share of the work (a (query, key) pair costs w tokens' weights), the
    bring-up's short forwards give a rate per unit of work, and a front of n tokens after s
    others is n + w (n s + n^2 / 2) of it: the split gives a long front less than a rate per
    token alone would, and both sides still end together."""
    w = 1e-4  # a 1B-like model: at 8k tokens, attention is about 40% of the work
    p = planner()
    p.attention_weight = w
    # forwards of 512 and 2048 tokens at 100k units/s past a 5 ms fixed cost
    t = lambda n: 0.005 + (n + w * n * n / 2) / 100_000  # noqa: E731
    p.calibrate_prefill((512, t(512)), (2048, t(2048)))
    assert p.prefill_tps.value == pytest.approx(100_000)
    assert p.prefill_overhead_s == pytest.approx(0.005)
    p.observe_prefill([(0, 4096)], t(4096))  # a real step on the same curve: no change
    assert p.prefill_tps.value == pytest.approx(100_000)
    # a step with decodes deep in their contexts beside the chunk: their work counts too
    decodes = [(30_000, 1)] * 8
    p.observe_prefill([(0, 4096), *decodes],
                      t(4096) + sum(p.work(s, n) for s, n in decodes) / 100_000)
    assert p.prefill_tps.value == pytest.approx(100_000)
    p.load_tps.value, p.load_latency_s.value = 100_000.0, 0.0
    flat = planner(prefill=100_000.0, load=100_000.0)
    flat.prefill_overhead_s = 0.005
    d, d_flat = p.admit(0, 512), flat.admit(0, 512)  # 8192 tokens
    assert d.first.num_tokens < d_flat.first.num_tokens
    x, rest = d.first.num_tokens, 8192 - d.load_from * BS
    assert x + rest >= 8192 and rest - (8192 - x) < BS  # the load starts where the front ends
    # they end together, to a block
    front_s, load_s = t(x), rest / 100_000
    assert abs(front_s - load_s) <= BS / 100_000 + BS * (1 + w * 8192) / 100_000
    # deep into a context, the same share costs more: the front takes less
    later = p.front_step(4096, 512, 512, None, 0.0)
    assert later.num_tokens < d.first.num_tokens * 4096 // 8192 + BS
