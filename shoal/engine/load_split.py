"""Compute or load? How a pool hit is split between the front the engine computes and the
back the connector loads (SPEC 3.1), from rates measured while the engine runs; the rules
and the stats that show them: docs/connectors.md, "Loads".

    tokens   c ..... front ....|.. dropped ..|..... queued / copying ....|.. landed .. e
             computed, a chunk  the front's   the load's (never touched   first-last
             a step             next chunks   by a forward)

Rates are exponentially weighted averages (the prefill rate per unit of work, `LoadPlanner.work`;
the load rates per source: store or host memory), kept between runs. Under TP the lead rank's
planner decides (KVTransfers shares its answers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.util import cdiv

SMOOTHING = 0.5  # weight of a new measurement in a rate
MIN_PREFILL_TOKENS = 32  # a step measures the prefill rate if it computes this many
# a load's own rate: at least this share of its wait counts as streaming (a first block
# landing sooner than the usual latency must not make the rate look unbounded)
MIN_STREAMING_SHARE = 0.25
# a load's own rate replaces earlier loads' once this many blocks landed, or before if it
# is this many times slower
MIN_OWN_RATE_BLOCKS = 8
OWN_RATE_SLACK = 4
# a finished load teaches one source's rate: the one at least this share of it came from
# (a mixed load teaches the other source's rate once one of the two is known)
ONE_SOURCE_SHARE = 0.9
# a load whose first block was seen landing this late (a share of its time) landed all at
# once: its time is all rate, no first-block latency
ALL_AT_ONCE = 0.9
# with no rate known for a load, the front waits for its first block at most this share of
# the time computing the hit takes, then computes it (a dead-slow store costs this much)
UNKNOWN_LOAD_WAIT = 0.05
# on a GPU a split must end at least this share sooner than the load alone: beside its load
# a front runs slower than the model says (the GIL and the GPU are shared). Not on a CPU
MIN_SPLIT_GAIN = 0.1
# slowdowns (a front beside its load, `observe_front`; a split's load beside its front,
# `observe_load`): averaged from 1, at most this much; each hit not split takes this share
# away (else a split once measured slow would never be tried, or measured, again)
MAX_SLOWDOWN = 8.0
SLOWDOWN_DECAY = 0.1
# the planner's rates (attribute, also its name in a rates file) -> their stats() key
RATES = {"prefill_tps": "prefill_tokens_per_s", "load_tps": "load_tokens_per_s",
         "load_latency_s": "load_latency_s", "host_load_tps": "host_load_tokens_per_s",
         "host_load_latency_s": "host_load_latency_s", "front_slowdown": "front_slowdown",
         "load_slowdown": "load_slowdown"}


@dataclass
class Ewma:
    value: float | None = None

    def add(self, x: float) -> None:
        if x > 0 and math.isfinite(x):
            self.value = x if self.value is None else (1 - SMOOTHING) * self.value + SMOOTHING * x

    @property
    def factor(self) -> float:
        """A slowdown's value (1 until measured)."""
        return self.value or 1.0


@dataclass(frozen=True)
class FrontStep:
    """What the front of a loading request does in one step."""

    num_tokens: int  # tokens the front may compute this step (before the load's limit)
    drop_to: int  # blocks below this index are the engine's: dropped from the load


@dataclass(frozen=True)
class LoadDecision:
    """At admission: how a hit is served."""

    load_from: int  # first block the connector loads (== the hit's end: nothing loaded)
    first: FrontStep | None  # the front's first step (None: the front waits for the load)


class LoadPlanner:
    """`attention_weight` (w): what a (query, key) pair of prefill attention costs against a
    token through the model's weights (LlamaModel.attention_weight): computing n tokens
    after `start` others is n + w (n start + n^2 / 2) units of work, so a long front costs
    more per token than the bring-up's short forwards."""

    def __init__(self, block_size: int, max_num_tokens: int, attention_weight: float = 0.0,
                 device: str = "cpu"):
        self.block_size = block_size
        # what a split must gain: MIN_SPLIT_GAIN on a GPU (`device`, the KV cache's; TP and
        # ADP ranks measure no launch time at bring-up)
        self.min_gain = MIN_SPLIT_GAIN if device.startswith("cuda") else 0.0
        self.max_num_tokens = max_num_tokens
        self.attention_weight = attention_weight
        self.prefill_tps = Ewma()  # work/s (`work`) of prefill forwards past their fixed cost
        self.prefill_overhead_s = 0.0  # a forward's fixed cost (weight reads)
        # no eager forward is shorter than its launches on the host (the GPU's work runs behind)
        self.prefill_launch_s = 0.0
        self.load_tps = Ewma()  # tokens/s of loads from the store once their first blocks landed
        self.load_latency_s = Ewma()  # seconds from a load's start to its first landed block
        self.host_load_tps = Ewma()  # the same, of loads from the worker's host memory
        self.host_load_latency_s = Ewma()
        self.front_slowdown = Ewma()  # a front's forward beside a load / its estimate alone
        self.load_slowdown = Ewma()  # a split's load beside its front / its estimate alone

    # -- measurements ----------------------------------------------------------------------

    def work(self, start: int, num_tokens: int) -> float:
        """The work of computing positions [start, start + num_tokens) of a request."""
        return num_tokens + self.attention_weight * num_tokens * (start + num_tokens / 2)

    def compute_seconds(self, start: int, num_tokens: int) -> float:
        """The expected time of a front's forward computing positions [start, start +
        num_tokens) beside its load (0 while the prefill rate is unknown)."""
        C = self.prefill_tps.value
        if not C:
            return 0.0
        return self._alone(self.work(start, num_tokens), C) * self.front_slowdown.factor

    def _alone(self, work: float, C: float) -> float:
        """A forward of `work` alone (no load beside it) at prefill rate C."""
        return max(self.prefill_launch_s, self.prefill_overhead_s + work / C)

    def _learn_slowdown(self, ratio: Ewma, x: float) -> None:
        """A measured slowdown x, averaged from 1, within [1, MAX_SLOWDOWN]."""
        ratio.value = ratio.factor
        ratio.add(min(max(x, 1.0), MAX_SLOWDOWN))

    def calibrate_prefill(self, small: tuple[int, float], large: tuple[int, float],
                          launch_s: float = 0.0) -> None:
        """Two forwards of different sizes from position 0, (tokens, seconds) each: the
        prefill rate from their difference (a short GPU forward alone is mostly launches)
        and a forward's fixed cost from the rest; `launch_s`: a forward's launches on the
        host (0 where they are its work)."""
        (n1, t1), (n2, t2) = small, large
        if not (t2 > t1 > 0 and n2 > n1):  # a noisy pair says nothing: keep what is known
            return
        self.prefill_launch_s = min(max(launch_s, 0.0), t2)
        w1, w2 = self.work(0, n1), self.work(0, n2)
        rate = (w2 - w1) / (t2 - t1)
        # this machine, now: replaces what the last run left (not averaged with it)
        self.prefill_overhead_s = min(max(t1 - w1 / rate, 0.0), t2 / 2)
        self.prefill_tps.value = rate

    def observe_step(self, batch, seconds: float) -> None:
        """An eager step (a ScheduledBatch) took `seconds`. One mostly of prefill measures the
        prefill rate if no load was pending (a load's I/O threads slow the steps they
        overlap), and the fronts' slowdown beside their loads if fronts were most of it."""
        if batch.num_tokens == len(batch.chunks):  # decodes only (the steady state: at once)
            return
        prefill = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1)
        if 2 * prefill < batch.num_tokens:  # decodes say little of the prefill rate
            return
        chunks = [(c.start, c.num_tokens) for c in batch.chunks]
        loading = batch.transfers.loading_ids
        if not loading:
            self.observe_prefill(chunks, seconds)
        elif 2 * sum(c.num_tokens for c in batch.chunks
                     if c.request.request_id in loading) >= batch.num_tokens:
            self.observe_front(chunks, seconds)

    def observe_prefill(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A step that is mostly prefill took `seconds`: its chunks, (start, num_tokens) each
        (decodes too: one token deep in a context is work as well)."""
        busy = seconds - self.prefill_overhead_s
        if (sum(n for _, n in chunks) >= MIN_PREFILL_TOKENS and busy > seconds / 4
                and seconds > 2 * self.prefill_launch_s):  # (else mostly its launches)
            self.prefill_tps.add(sum(self.work(s, n) for s, n in chunks) / busy)

    def observe_front(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """A step that was mostly a front beside its load took `seconds`; chunks as in
        observe_prefill."""
        C = self.prefill_tps.value
        if C and sum(n for _, n in chunks) >= MIN_PREFILL_TOKENS:
            alone = self._alone(sum(self.work(s, n) for s, n in chunks), C)
            self._learn_slowdown(self.front_slowdown, seconds / alone)

    def observe_load(self, num_tokens: int, seconds: float, first_landed_s: float | None,
                     host_share: float = 0.0, split: bool = False) -> None:
        """A finished load: `num_tokens` landed in `seconds`, the first of them after
        `first_landed_s` (None: not seen before the load finished, as if all at once);
        `host_share` of them were expected from host memory; `split`: planned beside a front,
        it teaches the load's slowdown, not the rates, unless faster than they say (taught as
        the store's rate, a slowed load makes loading whole look slower than it is). A load
        that landed nothing bounds its source's rate by a block in `seconds` (beside a front,
        g times that), else no engine would learn the rate of a dead-slow store."""
        if seconds <= 0:  # (times that say nothing)
            return
        g = self.load_slowdown.factor if split else 1.0
        from_host = host_share >= ONE_SOURCE_SHARE  # its rates: host memory's, else the store's
        rate, latency_s = ((self.host_load_tps, self.host_load_latency_s) if from_host
                           else (self.load_tps, self.load_latency_s))
        if num_tokens <= 0:
            rate.value = min(rate.value or math.inf, g * self.block_size / seconds)
            return
        expected = self.expected_rate(host_share)
        if split and expected is not None:
            ratio = seconds / (expected[1] + num_tokens / expected[0])
            self._learn_slowdown(self.load_slowdown, ratio)
            if ratio >= 1:  # (faster: alone the source is at least that fast, taught below)
                return
        # a first block seen this late (or not at all): one unit (the tier's blocks are one),
        # no first-block latency to tell from the rate
        at_once = first_landed_s is None or first_landed_s >= ALL_AT_ONCE * seconds
        streaming = seconds if at_once else max(seconds - first_landed_s, seconds / 2)
        if not at_once:
            latency_s.add(max(first_landed_s, 1e-6))
        if from_host or host_share <= 1 - ONE_SOURCE_SHARE:
            rate.add(num_tokens / streaming)
            return
        # mixed: what the known source's part did not take was the other's
        host, store = num_tokens * host_share, num_tokens * (1 - host_share)
        Lh, Ls = self.host_load_tps.value, self.load_tps.value
        if Lh is not None and streaming - host / Lh > 0:
            self.load_tps.add(store / (streaming - host / Lh))
        elif Ls is not None and streaming - store / Ls > 0:
            self.host_load_tps.add(host / (streaming - store / Ls))

    # -- decisions ---------------------------------------------------------------------------

    def admit(self, first: int, end: int, host_share: float = 0.0, ahead: int = 0) -> LoadDecision:
        """A hit of blocks [first, end) of a request that can compute while loading,
        `host_share` of it expected from host memory; its load starts once the loads before
        it brought in their `ahead` tokens (a store serves an engine's loads in turn)."""
        decision = self._admit(first, end, host_share, ahead)
        if decision.first is None or not decision.first.num_tokens:
            # not split: what a split would cost is not measured again by this hit
            for ratio in (r for r in (self.front_slowdown, self.load_slowdown) if r.value):
                ratio.value = 1 + (1 - SLOWDOWN_DECAY) * (ratio.value - 1)
        return decision

    def _admit(self, first: int, end: int, host_share: float, ahead: int) -> LoadDecision:
        front, remaining = first * self.block_size, (end - first) * self.block_size
        step = self.front_step(front, end, end, None, 0.0, host_share, ahead=ahead)
        C, rate = self.prefill_tps.value, self._load_rate(0, None, host_share, remaining, ahead)
        # a hit that loads takes one more forward (the prompt's rest, after the landed blocks)
        # than computing it all: the load must save more than that forward's fixed cost
        share = max(step.drop_to * self.block_size - front, 0)  # (the first step may have fewer)
        if step.drop_to >= end or (C is not None and rate is not None and self.work(
                front, remaining) / C < self._ends(front, share, remaining, rate)):
            return LoadDecision(end, None)  # computing it all is faster: nothing is loaded
        return LoadDecision(max(first, step.drop_to), step)

    def _ends(self, front: int, x: int, remaining: int, rate: tuple[float, float, float],
              busy: float = 0.0) -> float:
        """When a front of x of the `remaining` tokens (computed once `busy` seconds of the
        front's earlier forwards are done) and a load of the rest at `rate` (`_load_rate`)
        both end (beside a front, the load takes g times as long). Only with the prefill rate
        known."""
        L, latency, g = rate
        computed = busy + self.compute_seconds(front, x) if x else busy
        return max(computed, (latency + (remaining - x) / L) * (g if x or busy else 1.0))

    def front_step(self, front: int, landed_from: int, end: int,
                   started: float | None, now: float, host_share: float = 0.0,
                   busy: float = 0.0, ahead: int = 0) -> FrontStep:
        """The front at token `front` of a hit ending at block `end`; the load has landed
        the blocks from `landed_from` on; it started at `started` (None: not yet: it starts
        once the loads before it brought in their `ahead` tokens); `host_share` of the hit
        is expected from host memory; `busy`: seconds the front's forwards already launched
        still take (PendingLoad.front_busy)."""
        bs, C = self.block_size, self.prefill_tps.value
        remaining = landed_from * bs - front  # tokens between the front and the landed blocks
        if C is None or remaining <= 0:  # the prefill rate is unknown: the load goes on
            return FrontStep(0, 0)
        rate = self._load_rate((end - landed_from) * bs, None if started is None else now - started,
                               host_share, remaining, ahead)
        if rate is None:  # nothing known of the load yet: the front waits for a first word,
            # but not long once its turn came (a dead-slow store must not make the hit much
            # slower than computing; a store busy with the loads before it is not slow)
            if (started is not None
                    and now - started >= UNKNOWN_LOAD_WAIT * self.work(front, remaining) / C):
                return FrontStep(min(remaining, self.max_num_tokens), landed_from)
            return FrontStep(0, 0)
        L, latency, g = rate
        # the front's share x: they end together, busy + f (overhead + work(front, x) / C) =
        # g (latency + (R - x) / L) (f, g: each side's slowdown beside the other): a2 x^2 +
        # a1 x + a0 = 0, its positive root in a form stable at a2 = 0 (a forward's launches
        # bound it from below: checked on the share found)
        f = self.front_slowdown.factor
        a2 = f * self.attention_weight / (2 * C)
        a1 = f * (1 + self.attention_weight * front) / C + g / L
        a0 = busy + f * self.prefill_overhead_s - g * (latency + remaining / L)
        exact = -2 * a0 / (a1 + math.sqrt(max(a1 * a1 - 4 * a2 * a0, 0.0)))
        if remaining - exact < bs:  # the load would not add a block: compute it all
            return FrontStep(min(remaining, self.max_num_tokens), landed_from)
        share = max(int(exact) // bs * bs, 0)
        # of the block boundaries around the exact share, the one where both sides end
        # sooner (with a slow store, the block rounding down gives the load costs more)
        if (share + bs < remaining and self._ends(front, share + bs, remaining, rate, busy)
                < self._ends(front, share, remaining, rate, busy)):
            share += bs
        if (share < bs or self.work(front, share) < C * self.prefill_overhead_s  # less than a
                # forward's fixed cost buys, or a forward whose launches outlast the load
                or self._ends(front, share, remaining, rate, busy)
                > (1 - self.min_gain) * self._ends(front, 0, remaining, rate, busy)):
            return FrontStep(0, 0)  # the load lands it, the front waits
        # the share in one forward (its fixed cost paid once); the load from where it ends
        return FrontStep(min(share, self.max_num_tokens), cdiv(front + share, bs))

    def expected_rate(self, host_share: float) -> tuple[float, float] | None:
        """(tokens/s, seconds to the first landed block) of a load with `host_share` of its
        blocks in host memory, from earlier loads (None: nothing known). The host memory's
        blocks go first; a source not measured yet is taken to be as fast as the store."""
        Ls, Fs = self.load_tps.value, self.load_latency_s.value
        Lh, Fh = self.host_load_tps.value, self.host_load_latency_s.value
        if host_share <= 0 or Lh is None:
            return None if Ls is None else (Ls, Fs or 0.0)
        if host_share >= 1:
            return Lh, Fh or 0.0
        return None if Ls is None else (1 / (host_share / Lh + (1 - host_share) / Ls), Fh or 0.0)

    def decision_rates(self, host_share: float) -> dict[str, float]:
        """The rates a hit's decision weighs (0: not measured yet), as PoolHit keeps them."""
        load_tps, latency_s = self.expected_rate(host_share) or (0.0, 0.0)
        return {"prefill_tokens_per_s": self.prefill_tps.value or 0.0,
                "load_tokens_per_s": load_tps, "load_latency_s": latency_s}

    def _load_rate(self, num_landed: int, waited: float | None, host_share: float,
                   num_pending: int, ahead: int = 0) -> tuple[float, float, float] | None:
        """(tokens/s, seconds before the first block lands, slowdown beside a front) of the
        load from here (None: nothing known). Not started (`waited` None): earlier loads'
        rates, its first block after the `ahead` tokens of the loads before it. Before it has
        landed something: earlier loads' rates, but no faster than all its `num_pending`
        tokens in the time it is overdue (a slower store must not keep the front waiting; a
        load may land all at once). Then its
        own rate, counted from when a first block was due (else it would mostly measure the
        latency); it replaces earlier loads' once a few blocks landed, or sooner if far slower
        for long enough (the first blocks come while the reads ramp up)."""
        expected = self.expected_rate(host_share)
        F = expected[1] if expected is not None else self.load_latency_s.value
        if waited is not None and waited > 0 and num_landed > 0:
            streaming = max(waited - (F or 0.0), waited * MIN_STREAMING_SHARE)
            own = num_landed / streaming
            few = MIN_OWN_RATE_BLOCKS * self.block_size
            if (expected is None or num_landed >= few or (own * OWN_RATE_SLACK < expected[0]
                    and waited >= OWN_RATE_SLACK * (expected[1] + few / expected[0]))):
                return own, 0.0, 1.0  # (measured beside what runs now)
        if expected is None:
            return None
        L, F = expected
        g = self.load_slowdown.factor
        if waited is None:
            return L, F + ahead / L, g
        overdue = waited - F  # > 0: later than the latency, and no own rate to go by yet
        return (min(L, num_pending / overdue), 0.0, g) if overdue > 0 else (L, -overdue, g)

    def stats(self) -> dict[str, float]:
        return {key: getattr(self, name).value or 0.0 for name, key in RATES.items()}
