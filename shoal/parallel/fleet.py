"""A local fleet of rank processes, driven from the user's process (the front).

The front spawns one process per rank (multiprocessing "spawn"), gives them a
`tcp://127.0.0.1:<free port>` rendezvous, sends requests to the driver (rank 0) over a
pipe, and receives finished requests back. Requests and outputs never travel on the
collective group. If any rank dies or reports an error, the front raises, and
`shutdown()` ends every process it started.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import socket
import time
from dataclasses import replace
from multiprocessing.connection import wait

from shoal.config import EngineConfig
from shoal.model.llama import check_shardable
from shoal.model.loader import load_model_config, load_tokenizer_only
from shoal.parallel.rank import apply_record
from shoal.request import Request
from shoal.sampling import SamplingParams

READY_TIMEOUT_SECONDS = 600.0  # model loading on every rank
SHUTDOWN_TIMEOUT_SECONDS = 30.0
FATAL_REPORT_SECONDS = 30.0  # how long the front waits for every rank's failure report
POLL_SECONDS = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_connector_opt_in(connector_config, mode: str) -> None:
    """Refuse, before any process starts, a connector that cannot run in `mode` (ADP needs
    both classes to opt in; under TP any connector runs, led by rank 0)."""
    from shoal.connectors.registry import resolve_connector
    if mode != "adp":
        resolve_connector(connector_config)  # a bad name or module still fails here
        return
    for cls in resolve_connector(connector_config):
        if not getattr(cls, "supports_attention_dp", False):
            raise ValueError(f"connector class {cls.__module__}.{cls.__qualname__} does not "
                             "declare supports_attention_dp = True (required with dp_size > 1)")


class Router:
    """Assigns each ADP request to one owner: the least loaded (fewest unfinished requests);
    among equally loaded owners, the one that last took a request with the same first
    block of tokens (its prefix cache likely holds it); else the lowest rank."""

    def __init__(self, num_owners: int, block_size: int):
        self.load = [0] * num_owners
        self.block_size = block_size
        self._affinity: dict[tuple[int, ...], int] = {}  # first block's tokens -> owner

    def assign(self, prompt_token_ids: list[int]) -> int:
        least = min(self.load)
        candidates = [r for r, n in enumerate(self.load) if n == least]
        key = tuple(prompt_token_ids[:self.block_size])
        preferred = self._affinity.get(key) if len(prompt_token_ids) >= self.block_size else None
        owner = preferred if preferred in candidates else candidates[0]
        if len(prompt_token_ids) >= self.block_size:
            self._affinity[key] = owner
        self.load[owner] += 1
        return owner

    def release(self, owner: int) -> None:
        self.load[owner] -= 1


class FleetError(RuntimeError):
    """A rank died or failed: the fleet is unusable (restart required)."""


class Fleet:
    """Engine-like handle (add_request / step / stats / shutdown) over rank processes."""

    def __init__(self, config: EngineConfig):
        from shoal.parallel.rank import rank_main

        self.config = config
        self.mode = "tp" if config.tp_size > 1 else "adp"
        self.world_size = max(config.tp_size, config.dp_size)
        check_shardable(load_model_config(config.model), self.world_size,
                        "tp_size" if self.mode == "tp" else "dp_size")
        if config.kv_connector is not None:
            check_connector_opt_in(config.kv_connector, self.mode)
        self.tokenizer = load_tokenizer_only(config.model)
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conns, self._procs = [], []
        self._closed = False
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, name=f"shoal-rank-{rank}", daemon=True,
                               args=(rank, self.world_size, init_method, config, child,
                                     self.mode))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._ids = itertools.count()
        self._pending: dict[str, Request] = {}
        self._router = Router(self.world_size, config.block_size)
        self._owner: dict[str, int] = {}  # rid -> owner rank (ADP)
        self._arrivals: dict[int, list[dict]] = {}  # owner -> requests not yet sent
        self._finished_early: list[Request] = []  # arrived while collecting something else
        try:
            infos = self._collect("ready", READY_TIMEOUT_SECONDS)
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]

    @property
    def has_work(self) -> bool:
        return bool(self._pending)

    @property
    def _control_ranks(self) -> range:
        """Who takes stats/check/shutdown: the driver relays them in TP, each owner in ADP."""
        return range(1) if self.mode == "tp" else range(self.world_size)

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None,
                    cache_salt: str | None = None) -> Request:
        if not sampling.is_greedy and sampling.seed is None:
            # every rank samples the same token only from the same seed
            sampling = replace(sampling, seed=random.getrandbits(62))
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._pending:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, list(prompt_token_ids), sampling, frozenset(), cache_salt=cache_salt,
                      prompt=prompt)
        self._pending[rid] = req
        # TP: the driver takes every request; ADP: the router picks one owner
        owner = 0 if self.mode == "tp" else self._router.assign(req.prompt_token_ids)
        self._owner[rid] = owner
        # sent with the next step or message: requests added together reach their owner in
        # one message, so they are admitted at one step (as on one rank)
        self._arrivals.setdefault(owner, []).append(
            dict(prompt_token_ids=req.prompt_token_ids, sampling=sampling, request_id=rid,
                 cache_salt=cache_salt))
        return req

    def cancel(self, request_id: str) -> None:
        """Ask the request's owner (TP: the driver, for every rank) to cancel it."""
        owner = self._owner.get(request_id)
        if owner is not None:
            self._send(owner, ("cancel", request_id))

    def drain(self) -> list[Request]:
        """Cancel every unfinished request and wait until each came back (the owners wait
        for its pending transfers, each within control_grace_sec). Returns them (none once
        the fleet is stopped)."""
        if self._closed:
            return []
        for rid in list(self._pending):
            self.cancel(rid)
        ended = []
        while self._pending:
            ended += self.step()
        return ended

    def live_requests(self) -> dict[str, Request]:
        """Requests added and not yet returned, by id (output tokens arrive as generated)."""
        return self._pending

    def step(self) -> list[Request]:
        """Wait a little for tokens and finished requests from the ranks."""
        self._send_arrivals()
        finished, self._finished_early = self._finished_early, []
        for kind, rank, payload in self._receive(0.0 if finished else POLL_SECONDS):
            if kind == "done":
                finished += [self._finish(record) for record in payload]
        return finished

    def stats(self) -> dict:
        for rank in self._control_ranks:
            self._send(rank, ("stats", None))
        per_rank = self._collect("stats", READY_TIMEOUT_SECONDS)
        total = {k: sum(s[k] for s in per_rank) for k in per_rank[0]}
        return {**total, "per_rank": per_rank}

    def check_integrity(self) -> None:
        """Every rank checks its block accounting (Scheduler.check_integrity); AssertionError
        with the first rank's message if one fails."""
        for rank in self._control_ranks:
            self._send(rank, ("check", None))
        errors = [e for e in self._collect("checked", READY_TIMEOUT_SECONDS) if e]
        assert not errors, errors[0]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in self._control_ranks:
            try:
                if self._procs[rank].is_alive():
                    self._conns[rank].send(("shutdown", None))
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
        for conn in self._conns:
            conn.close()

    # -- internals ---------------------------------------------------------------------

    def _finish(self, record: dict) -> Request:
        req = self._pending.pop(record["request_id"])
        self._router.release(self._owner.pop(req.request_id))
        return apply_record(req, record)

    def _send(self, rank: int, msg) -> None:
        """Send `msg` after the requests added before it (a cancel finds its request)."""
        self._send_arrivals()
        self._post(rank, msg)

    def _send_arrivals(self) -> None:
        arrivals, self._arrivals = self._arrivals, {}
        for owner, specs in arrivals.items():
            self._post(owner, ("add", specs))

    def _post(self, rank: int, msg) -> None:
        if self._closed:
            raise RuntimeError("this fleet has been shut down")
        try:
            self._conns[rank].send(msg)
        except OSError as e:
            self._fail(f"rank {rank} is unreachable ({e})")

    def _receive(self, timeout: float) -> list[tuple[str, int, object]]:
        """Messages ready within `timeout`; raises FleetError if a rank died or failed."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        ready = wait([*self._conns, *sentinels], timeout)
        messages = []
        for obj in ready:
            if obj in sentinels:
                continue  # handled below, after reading what the rank said before dying
            while obj.poll():
                try:
                    messages.append(obj.recv())
                except (EOFError, OSError):  # the rank is gone; its sentinel says so below
                    break
        fatal = {rank: payload for kind, rank, payload in messages if kind == "fatal"}
        if fatal:
            self._fatal(fatal)
        for kind, rank, payload in messages:
            if kind == "tokens":
                for rid, ids in payload.items():
                    if rid in self._pending:
                        self._pending[rid].output_token_ids.extend(ids)
            elif kind == "error":
                self._fail(f"rank {rank} failed: {payload}")
        for i, proc in enumerate(self._procs):
            if not proc.is_alive():
                self._fail(f"rank {i} exited unexpectedly (exit code {proc.exitcode})")
        return messages

    def _collect(self, kind: str, timeout: float) -> list:
        """One `kind` message from every rank, in rank order."""
        got: dict[int, object] = {}
        waited = 0.0
        while len(got) < self.world_size:
            for k, rank, payload in self._receive(POLL_SECONDS):
                if k == kind:
                    got[rank] = payload
                elif k == "done":
                    for record in payload:
                        self._finished_early.append(self._finish(record))
            waited += POLL_SECONDS
            if waited > timeout:
                self._fail(f"no {kind!r} from ranks {sorted(set(range(self.world_size)) - set(got))}")
        return [got[r] for r in range(self.world_size)]

    def _fail(self, message: str) -> None:
        self.shutdown()
        raise FleetError(f"{message}; the fleet is stopped, a restart is required")

    def _fatal(self, messages: dict[int, str]) -> None:
        """A connector failure the ranks agreed on: each rank reports it and exits. Wait
        (bounded) for every rank's word, then raise it (ConnectorError, rank_messages set)."""
        from shoal.connectors.base import ConnectorError
        deadline = time.monotonic() + FATAL_REPORT_SECONDS
        while len(messages) < self.world_size and time.monotonic() < deadline:
            live = [i for i, p in enumerate(self._procs) if p.is_alive() and i not in messages]
            for i, conn in enumerate(self._conns):
                while i not in messages and conn.poll():
                    try:
                        kind, rank, payload = conn.recv()
                    except (EOFError, OSError):
                        break
                    if kind == "fatal":
                        messages[rank] = payload
            if not live:
                break
            wait([self._procs[i].sentinel for i in live], POLL_SECONDS)
        self.shutdown()
        error = ConnectorError(messages[min(messages)])
        error.rank_messages = messages
        raise error
