"""One rank's engine: requests in, one step at a time, results out.

    step = schedule -> sync with peers -> execute -> update -> report

The plain and overlap loops, the hooks around the forward and the steps that only poll
transfers: docs/design.md, "A step"."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from shoal.config import EngineConfig
from shoal.engine.build import build_engine_parts
from shoal.engine.model_runner import NO_TOKENS, ModelRunner, SampledTokens
from shoal.engine.peers import Peers, StepVote
from shoal.engine.scheduler import ScheduledBatch, Scheduler
from shoal.engine.connector_calls import keep_alive
from shoal.engine.transfers import TransferReport
from shoal.structured_output import Grammars
from shoal.request import NewRequest, Request, RequestOutput, RequestStatus, StepResult
from shoal.util import freeze_what_was_built

log = logging.getLogger(__name__)

# the longest pause of a step that only waits for transfers: new requests wait that long
IDLE_WAIT_SECONDS = 0.002
# the bring-up forwards that measure prefill: the longer one at most this long, the other a
# quarter of it (on a GPU, long enough for the GPU's work to outlast the launches)
PROBE_TOKENS_GPU, PROBE_TOKENS_CPU = 8192, 128

STAT_KEYS = (
    "iterations", "forward_passes", "forward_passes_skipped", "control_collectives", "pool_lookups",
    "pool_hit_blocks", "pool_miss_blocks", "connector_tokens_loaded", "bytes_loaded", "bytes_saved",
    "load_seconds", "save_seconds", "corrupt_blocks", "load_failures_recomputed",
    "deadline_expiries", "cancellations", "preemptions", "local_prefix_hit_tokens", "prompt_tokens",
    "generated_tokens", "missing_blocks", "save_failures", "blocks_loaded", "blocks_saved",
    "load_gbps", "save_gbps", "kv_blocks_used", "control_seconds", "forward_seconds",
    "transfers_aborted", "host_tier_hit_blocks", "pool_hits_loaded", "pool_hits_split",
    "pool_hits_computed", "front_tokens_computed", "prefill_tokens_per_s", "load_tokens_per_s",
    "load_latency_s", "host_load_tokens_per_s", "host_load_latency_s", "pool_hit_host_tokens",
    "front_slowdown", "load_slowdown",
)


@dataclass
class _Executed:
    """What executing one batch produced (on the executing thread)."""

    sampled: SampledTokens  # one per sampling chunk, in chunk order (maybe still on the device)
    transfers: TransferReport | None  # the connector's poll at the end of the step
    logprobs: list | None = None  # per sampled token: its TokenLogprobs or None (not asked)
    prompt_logprobs: list = field(default_factory=list)  # (rid, position, TokenLogprobs)
    started: float | None = 0.0  # perf_counter when the executing thread took it up (None: a graph)


class Engine:
    def __init__(self, config: EngineConfig, peers: Peers | None = None,
                 on_stuck: Callable[[str], None] | None = None):
        """`peers`: how this engine works with other ranks (shoal.parallel builds it; None:
        one rank). `on_stuck(message)`: called from the watchdog's thread when a connector
        hook blocks past transfer_timeout_sec (the engine's thread is stuck in it)."""
        self.config = config
        self.peers = peers or Peers()
        parts = build_engine_parts(config, self.peers, on_stuck)
        self.model, self.tokenizer, self.info = parts.model, parts.tokenizer, parts.info
        self.kv_cache, self.kv_manager = parts.kv_cache, parts.kv_manager
        self.transfers, self.eos_token_ids = parts.transfers, parts.eos_token_ids
        self.scheduler = Scheduler(self.kv_manager, config.max_num_tokens, config.max_batch_size,
                                   self.info.max_model_len, self.transfers)
        self.runner = ModelRunner(self.model, self.kv_cache, self.info.max_model_len,
                                  config.max_batch_size, config.enforce_eager,
                                  config.max_num_tokens)
        # structured output reads the vocabulary's text (the tokenizer loads at first use)
        tokenizer = self.tokenizer  # the callable holds it alone: no cycle keeps the engine
        self.runner.sampler.grammars = Grammars(lambda: tokenizer.hf, self.info.vocab_size,
                                                self.eos_token_ids)
        self._first_forwards()
        self._forward = (ThreadPoolExecutor(1, thread_name_prefix="shoal-forward")
                         if config.overlap_scheduler else None)  # None: the plain loop
        self._inflight: deque[tuple[ScheduledBatch, Future]] = deque()  # launched, not applied
        self._forget_ids: list[str] = []  # runner state to drop once no step can need it
        self._ids = itertools.count()
        self._live: dict[str, Request] = {}  # request id -> request, until it is returned
        self._rejected: list[Request] = []  # ended at add (returned by the next step)
        self._held: list[Request] = []  # ended while a save of theirs is pending (SAVING)
        self._num_streamed: dict[str, int] = {}  # rid -> output tokens handed out
        self._logprobs: dict[str, list] = {}  # rid -> TokenLogprobs per output token (if asked)
        self._prompt_logprobs: dict[str, dict] = {}  # rid -> {position: TokenLogprobs} (asked)
        # stats() counters; forward_seconds is the executing thread's (on a GPU: launch) time
        self._counts = {"iterations": 0, "forward_passes": 0, "forward_seconds": 0.0,
                        "prompt_tokens": 0, "generated_tokens": 0, "local_prefix_hit_tokens": 0}
        freeze_what_was_built()

    def _first_forwards(self) -> None:
        """On a GPU, a prefill forward pays the first forward's one-time costs here, not in
        the first request, and so does a block's tokens after a long context (a hit's last
        chunk: MLA and MoE models run other kernels there, whose first run cost DeepSeek-V2-
        Lite's shape 40 ms); with a pool that loads in part, two more measure the prefill
        rate a split starts from. One rank only: a rank in a group would wait for its peers."""
        measure = self.transfers is not None and self.transfers.partial_loads
        if self.peers.topology.world_size > 1 or not (measure or self.kv_cache.tensor.is_cuda):
            return
        # (no longer than a request can be: the probe takes a row of the block table too)
        large = min(self.config.max_num_tokens, PROBE_TOKENS_GPU if self.kv_cache.tensor.is_cuda
                    else PROBE_TOKENS_CPU, self.runner.table_width * self.runner.block_size)
        small = max(large // 4, 1)
        self.runner.time_prefill(small)
        # (its context as long as a request's may be: a last chunk is never longer)
        longest = min(PROBE_TOKENS_GPU, self.runner.table_width * self.runner.block_size)
        tail = min(self.runner.block_size, longest // 2)
        if self.kv_cache.tensor.is_cuda and tail:
            self.runner.time_prefill(tail, longest - tail)
        if measure:
            (t1, launch), (t2, _) = self.runner.time_prefill(small), self.runner.time_prefill(large)
            self.transfers.planner.calibrate_prefill((small, t1), (large, t2), launch)

    # -- requests ------------------------------------------------------------------------------

    def add(self, new: NewRequest) -> str:
        """Queue a request; returns its id. ValueError for an id in use or a token id outside
        the vocabulary; one that can never run (empty, longer than the context or the cache)
        ends with "error" at the next step."""
        rid = new.request_id or f"req-{next(self._ids)}"
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in use")
        new.check_vocab(self.info.vocab_size)
        stop = new.stop_ids(self.eos_token_ids, self.tokenizer)
        req = Request(rid, list(new.prompt_token_ids), new.sampling, stop,
                      cache_salt=new.cache_salt, prompt=new.prompt)
        try:
            self.scheduler.add(req)
        except Exception as e:  # this request cannot run: it fails alone, never the engine
            if not isinstance(e, ValueError):
                log.exception("request %s could not be prepared", rid)
            self.scheduler.finish(req, "error", f"{e}" if isinstance(e, ValueError) else
                                  f"the request could not be prepared: {type(e).__name__}: {e}")
            self._rejected.append(req)
        self._live[rid] = req
        return rid

    def wake(self) -> None:
        """Nothing to do: a step never waits for the driver's queued work."""

    def cancel(self, request_id: str) -> None:
        """End a request as "cancelled" (no-op if unknown or already ended). With a pending
        transfer it ends once that drains, within control_grace_sec."""
        req = self._live.get(request_id)
        if req is not None and not req.is_finished:
            if self.scheduler.cancel(req, defer_free=bool(self._inflight)):
                self._rejected.append(req)  # returned by the next step
                self._forget_ids.append(request_id)  # its runner state (sampler, table row)
        elif self.transfers is not None:  # ended; a save of it may still be pending
            self.transfers.deadlines.shorten(request_id)

    def live_requests(self) -> dict[str, Request]:
        """Requests added and not yet returned by step(), by id."""
        return self._live

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or bool(self._inflight) or bool(self._rejected)
                or self.failure is not None)

    @property
    def failure(self) -> str | None:
        """Why the engine stopped for good (a fatal connector failure), or None."""
        return None if self.transfers is None else self.transfers.failure

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """schedule -> sync with peers -> execute -> update -> report. Raises ConnectorError
        once the connector failed (the sync raises it; under ADP on every owner alike)."""
        self._counts["iterations"] += 1
        batch = self.scheduler.schedule()
        peers = self.peers.sync.exchange(StepVote(batch.num_tokens, self.has_work, self.failure))
        # a step runs if it computes, polls transfers or pads for a peer that computes
        runs = not batch.is_empty or batch.transfers.num_pending > 0 or peers.any_tokens
        polls_only = batch.is_empty and not peers.any_tokens  # no forward on any rank
        if runs:
            self._launch(batch, peers.token_counts)
        moves = self.transfers.num_moves if self.transfers is not None else 0
        # a step that only polls is applied at once: what its poll saw decides the wait
        ended = self._update(keep=1 if self._forward is not None and runs and not polls_only else 0)
        if polls_only and batch.transfers.num_pending and self.transfers.num_moves == moves:
            self.transfers.poller.wait(IDLE_WAIT_SECONDS)  # nothing moved: until something does
        return self._report(ended)

    def _launch(self, batch: ScheduledBatch, token_counts: list[int]) -> None:
        """Execute `batch`: here (plain loop) or on the forward thread (overlap loop)."""
        # runner state of requests that ended before the step in flight was launched: that
        # step may still read it; this one runs after it
        forget, self._forget_ids = self._forget_ids, []
        if self._forward is not None:
            future = self._forward.submit(self._execute, batch, token_counts, forget)
        else:
            future = Future()
            future.set_result(self._execute(batch, token_counts, forget))
        self._inflight.append((batch, future))

    def _execute(self, batch: ScheduledBatch, token_counts: list[int],
                 forget_ids: list[str]) -> _Executed:
        """One step's work on the executing thread: transfer hooks around the forward."""
        started = time.perf_counter()
        for request_id in forget_ids:
            self.runner.forget(request_id)
        transfers = self.transfers
        if transfers is not None:  # this owner's own plan (empty in a padding step)
            transfers.poller.begin_step(batch.transfers)
        sampled = NO_TOKENS
        if not batch.is_empty or any(token_counts):
            self._counts["forward_passes"] += 1
            start = time.perf_counter()
            # padding rows never reach a connector: no layer hooks for a padding forward
            hooks = transfers.layer_hooks if transfers is not None and not batch.is_empty else None
            sampled = self.runner.execute(batch, token_counts, hooks)
            self._counts["forward_seconds"] += time.perf_counter() - start
        report = transfers.poller.end_step(batch.transfers) if transfers is not None else None
        return _Executed(sampled, report, *self.runner.take_logprobs(),
                         None if self.runner.replayed else started)

    def _update(self, keep: int) -> list[Request]:
        """Apply executed steps, oldest first, until `keep` remain in flight. Returns the
        requests that ended."""
        ended = []
        while len(self._inflight) > keep:
            batch, future = self._inflight.popleft()
            out = future.result()
            sampled = out.sampled.tolist()  # waits for the device
            # an eager step's time, from when its thread took it up to its samples on the host
            if self.transfers is not None and out.started is not None:
                self.transfers.planner.observe_step(batch, time.perf_counter() - out.started)
            outcome = (None if out.transfers is None
                       else self.transfers.apply(batch.transfers, out.transfers))
            # (request, its output count before the update, TokenLogprobs) of each sample
            # whose request asked for logprobs (a sample the update drops gets none)
            asked = [(req, len(req.output_token_ids), lp)
                     for req, lp in zip(batch.sampled, out.logprobs or ()) if lp is not None]
            for rid, position, lp in out.prompt_logprobs:  # a recompute writes the same again
                self._prompt_logprobs.setdefault(rid, {})[position] = lp
            # a step still in flight may write the blocks of requests ending now
            done = self.scheduler.update(batch, sampled, bool(self._inflight), outcome)
            for req, num_before, logprobs in asked:  # kept for the tokens that were appended
                if len(req.output_token_ids) > num_before:
                    self._logprobs.setdefault(req.request_id, []).append(logprobs)
            self._forget_ids += [r.request_id for r in done]
            ended += done
        if not self._inflight:
            self.scheduler.release_deferred()
            for request_id in self._forget_ids:
                self.runner.forget(request_id)
            self._forget_ids = []
        return ended

    def _report(self, ended: list[Request]) -> StepResult:
        """New tokens of live requests, and the requests that are done: one whose save is in
        flight is held until the save is reported (a generate() returns after its saves)."""
        result = StepResult()
        for rid, req in self._live.items():
            n = self._num_streamed.get(rid, 0)
            if len(req.output_token_ids) > n:
                result.new_tokens[rid] = req.output_token_ids[n:]
                if rid in self._logprobs:
                    result.new_logprobs[rid] = self._logprobs[rid][n:]
                self._num_streamed[rid] = len(req.output_token_ids)
        pending, self._rejected = [*self._held, *self._rejected, *ended], []
        self._held = [r for r in pending if r.status == RequestStatus.SAVING]
        for req in pending:
            if req.status != RequestStatus.SAVING:
                self._live.pop(req.request_id, None)
                self._num_streamed.pop(req.request_id, None)
                self._counts["prompt_tokens"] += req.num_prompt_tokens
                self._counts["generated_tokens"] += len(req.output_token_ids)
                self._counts["local_prefix_hit_tokens"] += req.num_local_prefix_tokens or 0
                out = RequestOutput.from_request(req)
                out.logprobs = self._logprobs.pop(req.request_id, None)
                by_position = self._prompt_logprobs.pop(req.request_id, {})
                if req.sampling.prompt_logprobs is not None:
                    out.prompt_logprobs = [by_position.get(p) for p in range(req.num_prompt_tokens)]
                result.finished.append(out)
        return result

    # -- the rest ------------------------------------------------------------------------------

    def stats(self) -> dict:
        s, pool = dict.fromkeys(STAT_KEYS, 0), self.kv_manager.pool
        s.update(self._counts)
        s.update(forward_passes_skipped=s["iterations"] - s["forward_passes"],
                 preemptions=self.scheduler.num_preemptions,
                 cancellations=self.scheduler.num_cancellations,
                 kv_blocks_used=pool.num_blocks - pool.num_free_blocks,  # ref_count > 0
                 num_kv_blocks=pool.num_blocks,
                 # the server's gauges: running (a request whose KV loads computes its front
                 # meanwhile), and queued (new or preempted)
                 num_requests_running=len(self.scheduler.running),
                 num_requests_waiting=len(self.scheduler.waiting))
        s.update(self.peers.counters())
        if self.transfers is not None:
            s.update(self.transfers.stats())
        for kind, moved in (("load", "bytes_loaded"), ("save", "bytes_saved")):
            secs = s[f"{kind}_seconds"]  # summed over I/O threads
            s[f"{kind}_gbps"] = s[moved] / secs / 1e9 if secs else 0.0
        return s

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if not self._inflight:  # forgotten requests have given their table rows back
            self.runner.table_rows.check_integrity(held_by={*self._live, *self._forget_ids})

    def begin_drain(self) -> None:
        """Cancel every live request; every pending transfer gets at most control_grace_sec."""
        for rid in list(self._live):
            self.cancel(rid)
        if self.transfers is not None:
            self.transfers.deadlines.shorten_all()

    def drain(self) -> StepResult:
        """begin_drain, then step until nothing is pending. Returns what those steps did
        (nothing after a fatal failure: nothing is waited for then)."""
        result = StepResult()
        if self.failure is None:
            self.begin_drain()
            while self.has_work:
                result.merge(self.step())
        return result

    def shutdown(self) -> None:
        """Drain, then stop. After a fatal failure nothing is waited for and the KV memory
        stays referenced for the life of the process (a copy may still write it)."""
        if self.failure is None:
            self.drain()
        failed = self.failure is not None
        if failed:
            keep_alive(self.kv_cache)
        else:  # finish the step in flight; after a failure it may be stuck in a hook
            self._update(keep=0)
        if self._forward is not None:
            self._forward.shutdown(wait=not failed)
        if self.transfers is not None:
            self.transfers.shutdown()
