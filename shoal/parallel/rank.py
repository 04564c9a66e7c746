"""The loop of one rank process in a tensor-parallel fleet.

All ranks hold the same requests and run the same deterministic scheduler, so their
batches agree step for step without shipping batches around: rank 0 (the driver) takes
new requests from the front and broadcasts them, then every rank steps. Per iteration
there is one fixed-size control all-gather (new-request count, shutdown, stats flags);
a broadcast follows only when requests arrived. Rank 0 reports finished requests.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from multiprocessing.connection import Connection

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorError
from shoal.parallel.comm import Comm, ParallelInfo
from shoal.request import RequestStatus

IDLE_WAIT_SECONDS = 0.02  # how long an idle driver waits for new requests per iteration


def output_record(req) -> dict:
    """What the front needs of a finished request (plain data: it crosses a pipe)."""
    return {"request_id": req.request_id, "token_ids": list(req.output_token_ids),
            "finish_reason": req.finish_reason, "error": req.error,
            "arrival": req.metrics.arrival_time, "first_token": req.metrics.first_token_time,
            "finish": req.metrics.finish_time,
            "num_local_prefix_tokens": req.num_local_prefix_tokens or 0,
            "num_connector_tokens": req.num_connector_tokens}


def apply_record(req, record: dict):
    """Fill a front-side Request from a rank's output_record; returns it."""
    from shoal.request import RequestMetrics
    req.output_token_ids = record["token_ids"]
    req.finish_reason, req.error = record["finish_reason"], record["error"]
    req.metrics = RequestMetrics(record["arrival"], record["first_token"], record["finish"])
    req.num_local_prefix_tokens = record["num_local_prefix_tokens"]
    req.num_connector_tokens = record["num_connector_tokens"]
    return req


def agree_on_failure(comm: Comm, votes: list[int], failure: str | None) -> None:
    """After a control all-gather: if any rank voted a failure, a second round carries the
    messages and every rank raises the same ConnectorError (the lowest failed rank's)."""
    if any(votes):
        messages = comm.all_gather_object(failure)
        raise ConnectorError(next(m for m in messages if m))


def exit_fatal(rank: int, message: str, conn: Connection | None = None) -> None:
    """A fatal connector failure: report it to the front and end the process (nothing is
    freed under a copy that may still run; the peers see this rank gone and stop too)."""
    logging.getLogger(__name__).error("rank %d stops: %s", rank, message)
    if conn is not None:
        try:
            conn.send(("fatal", rank, message))
        except OSError:
            pass
    os._exit(1)


def on_stuck_exit(engine, rank: int, conn: Connection | None = None) -> None:
    """A connector hook that blocks on this rank ends the process (see exit_fatal): its
    peers are waiting for it in a collective, and its own thread cannot be unstuck."""
    if engine.connector is not None:
        engine.connector.on_stuck = lambda message: exit_fatal(rank, message, conn)


def rank_main(rank: int, world_size: int, init_method: str, config: EngineConfig,
              conn: Connection, mode: str = "tp") -> None:
    """Entry point of a spawned rank process."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    comm = None
    try:
        import torch

        from shoal.engine.engine import Engine
        # one machine's cores shared by its ranks, not oversubscribed world_size times
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        info, comm, config = join_group(rank, world_size, mode, config, init_method, rank)
        conn = _LockedConnection(conn)  # a watchdog's report may come from its own thread
        if mode == "tp":
            engine = Engine(config, info, comm)
            on_stuck_exit(engine, rank, conn)
            conn.send(("ready", rank, engine.info))
            _serve(rank, engine, comm, conn)
        else:
            fleet = _FleetState(comm)
            engine = Engine(config, info, comm, fleet_sync=fleet.sync)
            on_stuck_exit(engine, rank, conn)
            conn.send(("ready", rank, engine.info))
            _serve_owner(rank, engine, fleet, conn)
        conn.send(("stopped", rank, None))
    except ConnectorError as e:  # the same message on every rank: the fleet must restart
        exit_fatal(rank, str(e), conn)
    except BaseException as e:  # report anything to the front, then die with an error
        detail = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).error("rank %d failed: %s\n%s", rank, detail,
                                          traceback.format_exc())
        try:
            conn.send(("error", rank, detail))
        except OSError:
            pass
        os._exit(1)
    finally:
        if comm is not None:
            comm.shutdown()


def _serve(rank: int, engine, comm: Comm, conn: Connection) -> None:
    num_loops = 0
    outbox, streamer = _Outbox(), _Streamer()
    while True:
        num_loops += 1
        new, cancels, shutdown, want_stats, want_check = [], [], 0, 0, 0
        if rank == 0:
            timeout = 0.0 if engine.has_work else IDLE_WAIT_SECONDS
            while conn.poll(timeout):
                kind, payload = conn.recv()
                timeout = 0.0
                if kind == "add":
                    new += payload
                elif kind == "cancel":
                    cancels.append(payload)
                elif kind == "stats":
                    want_stats = 1
                elif kind == "check":
                    want_check = 1
                elif kind == "shutdown":
                    shutdown = 1
                    break
        failure = engine.failure
        rows = comm.all_gather_ints([len(new) + len(cancels), shutdown, want_stats, want_check,
                                     int(failure is not None)])
        agree_on_failure(comm, [r[4] for r in rows], failure)
        control = rows[0]
        if control[0]:  # arrivals and cancels reach every rank at the same step
            new, cancels = comm.broadcast_object((new, cancels) if rank == 0 else None, src=0)
        for spec in new:
            engine.add_request(**spec)
        for rid in cancels:
            engine.cancel(rid)
        if control[2]:
            conn.send(("stats", rank, {**engine.stats(), "rank_loop_iterations": num_loops,
                                       "control_broadcasts": comm.num_broadcasts,
                                       "data_collectives": comm.num_data_collectives}))
        if control[3]:
            conn.send(("checked", rank, _integrity_error(engine)))
        if control[1]:
            engine.shutdown()  # drains pending saves (every rank the same steps)
            return
        if engine.has_work:
            finished = outbox.ready(_step(engine))
            if rank == 0:
                streamer.send(conn, rank, engine, finished)


class _LockedConnection:
    """The rank's end of the front's pipe, sends serialized across threads."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    def poll(self, timeout: float = 0.0) -> bool:
        return self._conn.poll(timeout)

    def recv(self):
        return self._conn.recv()


def _step(engine) -> list:
    """engine.step(); a connector failure is kept for the next control vote (the ranks
    stay in lockstep so that every rank can raise the same error)."""
    try:
        return engine.step()
    except ConnectorError:
        return []


class _Streamer:
    """Sends the front new tokens of live requests after each step, and finished ones."""

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}  # rid -> tokens sent

    def send(self, conn: Connection, rank: int, engine, finished: list) -> None:
        new = {}
        for rid, req in engine.live_requests().items():
            n = self._sent.get(rid, 0)
            if len(req.output_token_ids) > n:
                new[rid] = req.output_token_ids[n:]
                self._sent[rid] = len(req.output_token_ids)
        if new:
            conn.send(("tokens", rank, new))
        if finished:
            for r in finished:
                self._sent.pop(r.request_id, None)
            conn.send(("done", rank, [output_record(r) for r in finished]))


def _integrity_error(engine) -> str | None:
    """engine.check_integrity() as a message for the front (None when it holds)."""
    try:
        engine.check_integrity()
    except AssertionError as e:
        return f"rank integrity check failed: {e}"
    return None


class _Outbox:
    """Finished requests go back to the front once nothing of theirs is pending: a request
    whose save is still in flight (SAVING) is held until the save is reported, as a
    single-rank generate() returns only after its saves."""

    def __init__(self) -> None:
        self._saving: list = []

    def ready(self, finished: list) -> list:
        pending = self._saving + finished
        self._saving = [r for r in pending if r.status == RequestStatus.SAVING]
        return [r for r in pending if r.status != RequestStatus.SAVING]


class _FleetState:
    """ADP: what the step's one control all-gather told this owner about the fleet."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.want_shutdown = 0  # this owner was asked to stop
        self.any_work = True  # some owner had work at the last step
        self.stop = False  # some owner was asked to stop: all stop after this step
        self.pending_transfers: list[int] = []  # per owner, at the last step

    def sync(self, num_tokens: int, has_work: bool, num_pending: int,
             failure: str | None = None) -> list[int]:
        """[num_tokens, has_work, shutdown, pending transfers, failed] of every owner, in one
        gather; a failure anywhere is raised on every owner (agree_on_failure)."""
        rows = self.comm.all_gather_ints([num_tokens, int(has_work), self.want_shutdown,
                                          num_pending, int(failure is not None)])
        agree_on_failure(self.comm, [r[4] for r in rows], failure)
        self.any_work = any(r[1] for r in rows)  # pending transfers count as work
        self.stop = any(r[2] for r in rows)
        self.pending_transfers = [r[3] for r in rows]
        return [r[0] for r in rows]


def _serve_owner(rank: int, engine, fleet: _FleetState, conn: Connection) -> None:
    """ADP: this owner's own requests; every owner steps every iteration (the step's
    all-gather decides whether anyone computes; an owner with nothing joins with padding)."""
    num_loops = 0
    outbox, streamer = _Outbox(), _Streamer()
    while True:
        num_loops += 1
        timeout = 0.0 if fleet.any_work else IDLE_WAIT_SECONDS
        while conn.poll(timeout):
            kind, payload = conn.recv()
            timeout = 0.0
            if kind == "add":
                for spec in payload:
                    engine.add_request(**spec)
            elif kind == "cancel":
                engine.cancel(payload)
            elif kind == "stats":
                conn.send(("stats", rank, {**engine.stats(), "rank_loop_iterations": num_loops,
                                           "data_collectives": engine.comm.num_data_collectives}))
            elif kind == "check":
                conn.send(("checked", rank, _integrity_error(engine)))
            elif kind == "shutdown":
                fleet.want_shutdown = 1
        streamer.send(conn, rank, engine, outbox.ready(engine.step()))
        if fleet.stop:
            # drain: every owner cancels what it has and steps until no owner has pending
            # transfers (the steps' all-gathers keep them together), then stops
            engine.begin_drain()
            while fleet.any_work:
                streamer.send(conn, rank, engine, outbox.ready(engine.step()))
            engine.shutdown()
            return


def join_group(rank: int, world_size: int, mode: str, config: EngineConfig, init_method: str,
               local_rank: int) -> tuple[ParallelInfo, Comm, EngineConfig]:
    """This process's place in the fleet, its process group, and its config (on CUDA, one
    GPU per rank: cuda:<local_rank>). Shared by spawned fleets and torchrun."""
    from dataclasses import replace

    tp, dp = (world_size, 1) if mode == "tp" else (1, world_size)
    info = ParallelInfo(rank, world_size, tp_size=tp, dp_size=dp, mode=mode)
    cuda = config.device.startswith("cuda")
    comm = Comm(info, "nccl" if cuda else "gloo", init_method)
    if cuda:
        config = replace(config, device=f"cuda:{local_rank}")
    return info, comm, config
