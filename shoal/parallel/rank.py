"""A rank process: its place in the group, and the one loop every rank runs.

    take orders -> apply them (add, cancel, stats, check) -> stop? -> step -> send results

Where orders come from is an inbox: the front's pipe in a spawned fleet (`PipeInbox`), or
the whole request list at once under torchrun (`ListInbox`, closed after it is taken).
How ranks agree is the mode's policy:
- TP (`TpPolicy`): all ranks hold the same requests and run the same deterministic
  scheduler, so their batches agree without shipping batches. Rank 0 reads the inbox; one
  fixed-size control all-gather per iteration tells every rank what arrived (a broadcast
  then carries it), whether to stop, who has work, and any rank's connector failure.
  Rank 0 reports results.
- ADP (`AdpPolicy`): every owner reads its own inbox and reports its own results; the
  step's own all-gather (`AdpSync`) keeps the owners together, every owner steps every
  iteration, and a stop drains every owner until none has pending transfers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from shoal.config import EngineConfig
from shoal.connectors.base import ConnectorError
from shoal.engine.engine import Engine
from shoal.engine.peers import LocalAgreement, LocalSync, Peers, Topology
from shoal.model.shard import Shard
from shoal.parallel import messages as msg
from shoal.parallel.agreement import TpAgreement
from shoal.parallel.comm import Comm
from shoal.parallel.sync import AdpSync, agree_on_failure
from shoal.request import NewRequest, StepResult

IDLE_WAIT_SECONDS = 0.02  # how long an idle rank waits for orders per iteration

log = logging.getLogger(__name__)


def join_group(rank: int, world_size: int, mode: str, config: EngineConfig, init_method: str,
               local_rank: int) -> tuple[Peers, Comm, EngineConfig]:
    """This process's process group, what its engine needs to know about its peers, and its
    config (on CUDA one GPU per rank: cuda:<local_rank>). Spawned fleets and torchrun."""
    cuda = config.device.startswith("cuda")
    comm = Comm(rank, world_size, "nccl" if cuda else "gloo", init_method)
    if cuda and world_size > 1:  # (a rank of its own keeps the GPU it was given)
        config = replace(config, device=f"cuda:{local_rank}")
    if mode == "tp":  # heads and MLP sharded; every rank the same requests
        peers = Peers(Topology(rank, world_size, shard_rank=rank, num_shards=world_size),
                      Shard(rank, world_size, comm.all_reduce_), LocalSync(),
                      TpAgreement(comm), comm.counters)
    else:  # ADP: attention whole per owner, MLP sharded over the owners
        peers = Peers(Topology(rank, world_size, owner_rank=rank, num_owners=world_size),
                      Shard(rank, world_size, comm.all_reduce_, comm.all_gather_),
                      AdpSync(comm), LocalAgreement(), comm.counters)
    return peers, comm, config


@dataclass
class Orders:
    """What a rank is asked to do in one iteration."""

    adds: list[NewRequest] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    want_stats: bool = False
    want_check: bool = False
    shutdown: bool = False


class PipeInbox:
    """Orders from the front's pipe (never closed: the front sends Shutdown)."""

    closed = False
    is_replicated = False  # TP: only rank 0's pipe brings requests

    def __init__(self, conn: Connection):
        self.conn = conn

    def take(self, timeout: float) -> Orders:
        orders = Orders()
        while self.conn.poll(timeout):
            timeout = 0.0
            m = self.conn.recv()
            if isinstance(m, msg.Add):
                orders.adds += m.requests
            elif isinstance(m, msg.Cancel):
                orders.cancels.append(m.request_id)
            elif isinstance(m, msg.AskStats):
                orders.want_stats = True
            elif isinstance(m, msg.AskCheck):
                orders.want_check = True
            elif isinstance(m, msg.Shutdown):
                orders.shutdown = True
                break
        return orders


class ListInbox:
    """Every request at once (torchrun); closed once taken: the run ends when all are done.
    Under TP every rank is given the same list (`is_replicated`: nothing to broadcast)."""

    def __init__(self, requests: list[NewRequest], is_replicated: bool = False):
        self._requests = requests
        self.closed = False
        self.is_replicated = is_replicated

    def take(self, timeout: float) -> Orders:
        orders, self._requests, self.closed = Orders(adds=self._requests), [], True
        return orders


class PipeOutbox:
    """Sends to the front; results only if this rank reports them (TP: rank 0)."""

    def __init__(self, conn: Connection, rank: int, sends_results: bool):
        self.rank = rank
        self.sends_results = sends_results
        self._conn = conn
        self._lock = threading.Lock()  # a watchdog's report may come from its own thread

    def send(self, m: msg.ToFront) -> None:
        with self._lock:
            self._conn.send(m)

    def results(self, result: StepResult) -> None:
        if result and self.sends_results:
            self.send(msg.Results(self.rank, result))


class CollectOutbox:
    """Keeps results here (torchrun: gathered at the end)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.collected = StepResult()

    def send(self, m: msg.ToFront) -> None:
        pass

    def results(self, result: StepResult) -> None:
        self.collected.merge(result)


class TpPolicy:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.any_work = False  # some rank had work at the last control gather
        self.closed = False  # rank 0's inbox will bring no more requests

    def take(self, engine: Engine, inbox) -> Orders:
        """Rank 0's orders on every rank, agreed in one gather (+ a broadcast of arrivals)."""
        orders = Orders()
        if self.comm.rank == 0 or inbox.is_replicated:
            orders = inbox.take(0.0 if engine.has_work else IDLE_WAIT_SECONDS)
        failure = engine.failure
        rows = self.comm.all_gather_ints([
            len(orders.adds) + len(orders.cancels), int(orders.shutdown), int(orders.want_stats),
            int(orders.want_check), int(failure is not None), int(engine.has_work),
            int(inbox.closed)])
        agree_on_failure(self.comm, [r[4] for r in rows], failure)
        self.any_work = any(r[5] for r in rows)
        lead = rows[0]
        self.closed = bool(lead[6])
        adds, cancels = orders.adds, orders.cancels
        if lead[0] and not inbox.is_replicated:  # arrivals and cancels reach every rank at once
            adds, cancels = self.comm.broadcast_object(
                (orders.adds, orders.cancels) if self.comm.rank == 0 else None, src=0)
        return Orders(adds, cancels, bool(lead[2]), bool(lead[3]), bool(lead[1]))

    def stops(self, orders: Orders, inbox) -> bool:
        return orders.shutdown or (self.closed and not self.any_work and not orders.adds)

    def steps(self, engine: Engine) -> bool:
        return engine.has_work  # the same on every rank

    def stop(self, engine: Engine, outbox) -> None:
        engine.shutdown()  # drains pending saves, every rank the same steps


class AdpPolicy:
    def __init__(self, sync: AdpSync):
        self.sync = sync
        self.comm = sync.comm

    def take(self, engine: Engine, inbox) -> Orders:
        orders = inbox.take(0.0 if self.sync.state.any_work else IDLE_WAIT_SECONDS)
        if orders.shutdown:
            self.sync.want_shutdown = 1  # voted at the next step: every owner stops alike
        return orders

    def stops(self, orders: Orders, inbox) -> bool:
        """Decided by the last step's gather, so every owner stops at the same iteration."""
        state = self.sync.state
        return state.stop or (inbox.closed and not state.any_work)

    def steps(self, engine: Engine) -> bool:
        return True  # the step's all-gather is how owners stay together

    def stop(self, engine: Engine, outbox) -> None:
        # every owner cancels what it has and steps until no owner has pending transfers
        # (the steps' all-gathers keep them together), then stops
        engine.begin_drain()
        while self.sync.state.any_work:
            outbox.results(engine.step())
        engine.shutdown()


def serve(engine: Engine, policy, inbox, outbox) -> None:
    """The rank loop, until the policy says stop."""
    num_loops = 0
    while True:
        num_loops += 1
        orders = policy.take(engine, inbox)
        for new in orders.adds:
            engine.add(new)
        for rid in orders.cancels:
            engine.cancel(rid)
        if orders.want_stats:
            comm = policy.comm
            outbox.send(msg.Stats(outbox.rank, {
                **engine.stats(), "rank_loop_iterations": num_loops,
                "control_broadcasts": comm.num_broadcasts,
                "data_collectives": comm.num_data_collectives}))
        if orders.want_check:
            outbox.send(msg.Checked(outbox.rank, _integrity_error(engine)))
        if policy.stops(orders, inbox):
            policy.stop(engine, outbox)
            return
        if policy.steps(engine):
            outbox.results(engine.step())


def make_policy(peers: Peers, comm: Comm):
    return AdpPolicy(peers.sync) if isinstance(peers.sync, AdpSync) else TpPolicy(comm)


def rank_main(rank: int, world_size: int, init_method: str, config: EngineConfig,
              conn: Connection, mode: str, environ: dict[str, str]) -> None:
    """Entry point of a rank process the front started; `environ`: the front's environment
    (a rank forked from the preloading server would otherwise see the server's)."""
    # Ctrl-C and SIGTERM are the front's to handle: it shuts the ranks down in order (a
    # SIGTERM to the server's whole process group, as systemd stops a service, killed the
    # engine's process under the requests the server was draining); a rank whose front is
    # gone ends when its pipe closes, and one that does not stop is killed (Fleet.shutdown)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    outbox = PipeOutbox(conn, rank, sends_results=mode == "adp" or rank == 0)
    comm = None
    try:
        import torch
        # one machine's cores shared by its ranks, not oversubscribed world_size times
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        peers, comm, config = join_group(rank, world_size, mode, config, init_method, rank)
        engine = Engine(config, peers, on_stuck=lambda message: exit_fatal(rank, message, outbox))
        outbox.send(msg.Ready(rank, engine.info))
        serve(engine, make_policy(peers, comm), PipeInbox(conn), outbox)
        outbox.send(msg.Stopped(rank))
    except ConnectorError as e:  # the same message on every rank: the fleet must restart
        exit_fatal(rank, str(e), outbox)
    except BaseException as e:  # report anything to the front, then die with an error
        log.debug("rank %d failed", rank, exc_info=True)
        exit_fatal(rank, f"{type(e).__name__}: {e}", outbox, msg.Failed)
    finally:
        if comm is not None:
            comm.shutdown()
    # Stopped, saves drained, the group left: the process ends here, without the interpreter's
    # teardown of torch (about 0.8 s on a CPU machine, which every fleet shutdown waited for)
    try:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # a closed or broken stream: nothing left to say on it
        pass
    os._exit(0)


def exit_fatal(rank: int, message: str, outbox: PipeOutbox | None = None,
               kind: type = msg.Fatal) -> None:
    """Report why this rank stops to the front and end the process (nothing is freed under a
    copy that may still run; the peers see this rank gone and stop too). With a front, the
    front says it (one line for the user); without one (torchrun) this log line does."""
    log.log(logging.DEBUG if outbox is not None else logging.ERROR, "rank %d stops: %s",
            rank, message)
    if outbox is not None:
        try:
            outbox.send(kind(rank, message))
        except OSError:
            pass
    os._exit(1)


def _integrity_error(engine: Engine) -> str | None:
    """engine.check_integrity() as a message for the front (None when it holds)."""
    try:
        engine.check_integrity()
    except AssertionError as e:
        return f"rank integrity check failed: {e}"
    return None
