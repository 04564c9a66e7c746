"""A local fleet of rank processes, driven from the user's process (the front).

The front starts one process per rank (forked from a preloaded server on CPU, spawned
on CUDA: `_start_method`), gives them a
`tcp://127.0.0.1:<free port>` rendezvous, sends requests over pipes (TP: all to rank 0;
ADP: each to the owner the router picks) as `shoal.parallel.messages`, and receives each
step's results back. Requests and outputs never travel on the
collective group. If any rank dies or reports an error, the front raises, and
`shutdown()` ends every process it started.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import random
import signal
import socket
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorError
from shoal.connectors.registry import resolve_connector
from shoal.engine.load_split import RATES
from shoal.model.llama import check_shardable
from shoal.model.loader import load_model_config, load_tokenizer_only
from shoal.parallel import messages as msg
from shoal.parallel.router import Router
from shoal.request import NewRequest, StepResult

READY_TIMEOUT_SECONDS = 600.0  # model loading on every rank
SHUTDOWN_TIMEOUT_SECONDS = 30.0
FATAL_REPORT_SECONDS = 30.0  # how long the front waits for every rank's failure report
POLL_SECONDS = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method(config: EngineConfig):
    """CPU ranks fork from a server process that imported torch and Shoal once (each rank
    then starts in well under a second instead of importing them again, about 2 s);
    CUDA ranks are spawned (a fork must never inherit a CUDA context). A rank takes the
    front's environment as it is at the fleet's start either way (rank_main)."""
    if config.device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["shoal.parallel.rank"])  # used when the server starts
    return ctx


@contextlib.contextmanager
def _ranks_ignore_stop_signals():
    """Processes started inside inherit SIGINT and SIGTERM ignored (the forkserver too, which
    reports its children's ends): a Ctrl-C, or a SIGTERM to the server's whole process group
    (as systemd stops a service), reaches the front, which shuts the ranks down in order
    after draining, not every rank with a traceback of its own."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal dispositions can only be changed from the main thread
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class FleetError(RuntimeError):
    """A rank died or failed: the fleet is unusable (restart required)."""


class Fleet:
    """The engine interface (shoal.driver.EngineLike) over rank processes."""

    def __init__(self, config: EngineConfig):
        from shoal.parallel.rank import rank_main

        self.config = config
        # (one rank of its own, `engine_process`: as TP's rank 0, which steps only with work)
        self.mode = "adp" if config.dp_size > 1 else "tp"
        self.world_size = max(config.tp_size, config.dp_size)
        model_config = load_model_config(config.model)
        check_shardable(model_config, self.world_size,
                        "tp_size" if self.mode == "tp" else "dp_size")
        self._eos = frozenset(model_config.eos_token_ids)
        if config.kv_connector is not None:  # a bad connector fails before any process starts
            resolve_connector(config.kv_connector, attention_dp=self.mode == "adp")
        self.tokenizer = load_tokenizer_only(config.model)
        ctx = _start_method(config)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conns, self._procs = [], []
        self._closed = False
        with _ranks_ignore_stop_signals():
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, name=f"shoal-rank-{rank}", daemon=True,
                                   args=(rank, self.world_size, init_method, config, child,
                                         self.mode, dict(os.environ)))
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        # written to by `wake`: a step waiting for the ranks returns (the driver has work);
        # one wake at most waits in it (an idle fleet's pipe is not read: it never fills)
        self._woken, self._waker = mp.Pipe(duplex=False)
        self._wake_lock = threading.Lock()
        self._wake_sent = False
        self._ids = itertools.count()
        self._router = Router(self.world_size, config.block_size)
        self._owner: dict[str, int] = {}  # rid -> owner rank (TP: 0), until it comes back
        self._arrivals: dict[int, list[NewRequest]] = {}  # owner -> requests not yet sent
        self._early = StepResult()  # results that arrived while collecting something else
        try:
            infos = [m.info for m in self._collect(msg.Ready, READY_TIMEOUT_SECONDS)]
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]

    @property
    def has_work(self) -> bool:
        return bool(self._owner)

    @property
    def _control_ranks(self) -> range:
        """Who takes stats/check/shutdown: rank 0 relays them in TP, each owner in ADP."""
        return range(1) if self.mode == "tp" else range(self.world_size)

    def add(self, new: NewRequest) -> str:
        sampling = new.sampling
        if not sampling.is_greedy and sampling.seed is None:
            # every rank samples the same token only from the same seed
            sampling = replace(sampling, seed=random.getrandbits(62))
        rid = new.request_id or f"req-{next(self._ids)}"
        if rid in self._owner:
            raise ValueError(f"request_id {rid!r} is already in use")
        new.check_vocab(self.info.vocab_size)  # the ranks never see a bad prompt
        new.stop_ids(self._eos, self.tokenizer)  # nor one that cannot run
        # TP: rank 0 takes every request; ADP: the router picks one owner
        owner = 0 if self.mode == "tp" else self._router.assign(new.prompt_token_ids)
        self._owner[rid] = owner
        # sent with the next step or message: requests added together reach their owner in
        # one message, so they are admitted at one step (as on one rank)
        self._arrivals.setdefault(owner, []).append(replace(new, request_id=rid,
                                                            sampling=sampling))
        return rid

    def cancel(self, request_id: str) -> None:
        """Ask the request's owner (TP: rank 0, for every rank) to cancel it."""
        owner = self._owner.get(request_id)
        if owner is not None:
            self._send(owner, msg.Cancel(request_id))

    def drain(self) -> StepResult:
        """Cancel every unfinished request and wait until each came back (the owners wait
        for its pending transfers, each within control_grace_sec). Returns what came back
        (nothing once the fleet is stopped)."""
        result = StepResult()
        if self._closed:
            return result
        for rid in list(self._owner):
            self.cancel(rid)
        while self._owner:
            result.merge(self.step())
        return result

    def step(self) -> StepResult:
        """Wait a little for the ranks' results."""
        self._send_arrivals()
        result, self._early = self._early, StepResult()
        for m in self._receive(0.0 if result else POLL_SECONDS):
            if isinstance(m, msg.Results):
                result.merge(self._returned(m.result))
        return result

    def wake(self) -> None:
        """The driver queued work: a `step` waiting for the ranks' results returns now."""
        with self._wake_lock:  # (held while writing: `shutdown` closes the pipe under it)
            if self._wake_sent or self._closed:
                return
            self._wake_sent = True
            self._waker.send_bytes(b"")

    def stats(self) -> dict:
        for rank in self._control_ranks:
            self._send(rank, msg.AskStats())
        per_rank = [m.stats for m in self._collect(msg.Stats, READY_TIMEOUT_SECONDS)]
        total = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
        for k in RATES.values():  # a rate of every rank is not a sum
            measured = [s[k] for s in per_rank if s.get(k)]
            total[k] = sum(measured) / len(measured) if measured else 0.0
        return {**total, "per_rank": per_rank}

    def check_integrity(self) -> None:
        """Every rank checks its block accounting (Scheduler.check_integrity); AssertionError
        with the first rank's message if one fails."""
        for rank in self._control_ranks:
            self._send(rank, msg.AskCheck())
        errors = [m.error for m in self._collect(msg.Checked, READY_TIMEOUT_SECONDS) if m.error]
        if errors:
            raise AssertionError(errors[0])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in self._control_ranks:
            try:
                if self._procs[rank].is_alive():
                    self._conns[rank].send(msg.Shutdown())
            except OSError:
                pass
        # ranks drain pending saves first: each gets at most control_grace_sec
        grace = 0.0 if self.config.kv_connector is None else self.config.kv_connector.control_grace_sec
        end = time.monotonic() + grace + SHUTDOWN_TIMEOUT_SECONDS
        for proc in self._procs:
            proc.join(max(end - time.monotonic(), 0.1))
        for proc in self._procs:  # whatever did not stop by itself
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        with self._wake_lock:  # no wake writes meanwhile
            for conn in (*self._conns, self._woken, self._waker):
                conn.close()

    # -- internals ---------------------------------------------------------------------

    def _returned(self, result: StepResult) -> StepResult:
        """A rank's results: its finished requests are no longer the fleet's."""
        for out in result.finished:
            owner = self._owner.pop(out.request_id)
            if self.mode == "adp":
                self._router.release(owner)
        return result

    def _send(self, rank: int, m: msg.ToRank) -> None:
        """Send `m` after the requests added before it (a cancel finds its request)."""
        self._send_arrivals()
        self._post(rank, m)

    def _send_arrivals(self) -> None:
        arrivals, self._arrivals = self._arrivals, {}
        for owner, requests in arrivals.items():
            self._post(owner, msg.Add(requests))

    def _post(self, rank: int, m: msg.ToRank) -> None:
        if self._closed:
            raise RuntimeError("this fleet has been shut down")
        try:
            self._conns[rank].send(m)
        except OSError as e:
            self._fail(f"rank {rank} is unreachable ({e})")

    def _receive(self, timeout: float) -> list[msg.ToFront]:
        """Messages ready within `timeout`; raises FleetError if a rank died or failed."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        ready = wait([*self._conns, *sentinels, self._woken], timeout)
        messages = []
        for obj in ready:
            if obj is self._woken:
                while self._woken.poll():
                    self._woken.recv_bytes()
                with self._wake_lock:  # (after the read: a wake meanwhile finds this step
                    self._wake_sent = False  # returning, its op runs after it)
                continue
            if obj in sentinels:
                continue  # handled below, after reading what the rank said before dying
            while obj.poll():
                try:
                    messages.append(obj.recv())
                except (EOFError, OSError):  # the rank is gone; its sentinel says so below
                    break
        fatal = {m.rank: m.message for m in messages if isinstance(m, msg.Fatal)}
        if fatal:
            self._fatal(fatal)
        for m in messages:
            if isinstance(m, msg.Failed):
                self._fail(f"rank {m.rank} failed: {m.detail}")
        for i, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._fail(f"rank {i} exited unexpectedly (exit code {proc.exitcode})")
        return messages

    def _collect(self, kind: type, timeout: float) -> list:
        """One `kind` message from every rank, in rank order."""
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout  # a wait ends early whenever results arrive
        while len(got) < self.world_size:
            for m in self._receive(POLL_SECONDS):
                if isinstance(m, kind):
                    got[m.rank] = m
                elif isinstance(m, msg.Results):
                    self._early.merge(self._returned(m.result))
            if time.monotonic() > deadline:
                self._fail(f"no {kind.__name__} from ranks "
                           f"{sorted(set(range(self.world_size)) - set(got))}")
        return [got[r] for r in range(self.world_size)]

    def _fail(self, message: str) -> None:
        self.shutdown()
        raise FleetError(f"{message}; the fleet is stopped, a restart is required")

    def _fatal(self, messages: dict[int, str]) -> None:
        """A connector failure the ranks agreed on: each rank reports it and exits. Wait
        (bounded) for every rank's word, then raise it (ConnectorError, rank_messages set)."""
        deadline = time.monotonic() + FATAL_REPORT_SECONDS
        while len(messages) < self.world_size and time.monotonic() < deadline:
            live = [i for i, p in enumerate(self._procs) if p.is_alive() and i not in messages]
            for i, conn in enumerate(self._conns):
                while i not in messages and conn.poll():
                    try:
                        m = conn.recv()
                    except (EOFError, OSError):
                        break
                    if isinstance(m, msg.Fatal):
                        messages[m.rank] = m.message
            if not live:
                break
            wait([self._procs[i].sentinel for i in live], POLL_SECONDS)
        self.shutdown()
        error = ConnectorError(messages[min(messages)])
        error.rank_messages = messages
        raise error
