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
import traceback
from multiprocessing.connection import Connection

from shoal.config import EngineConfig
from shoal.parallel.comm import Comm, ParallelInfo

IDLE_WAIT_SECONDS = 0.02  # how long an idle driver waits for new requests per iteration
CONTROL_FIELDS = 3  # [num_new_requests, shutdown, stats_requested]


def output_record(req) -> dict:
    """What the front needs of a finished request (plain data: it crosses a pipe)."""
    return {"request_id": req.request_id, "token_ids": list(req.output_token_ids),
            "finish_reason": req.finish_reason, "error": req.error,
            "arrival": req.metrics.arrival_time, "first_token": req.metrics.first_token_time,
            "finish": req.metrics.finish_time,
            "num_local_prefix_tokens": req.num_local_prefix_tokens or 0,
            "num_connector_tokens": req.num_connector_tokens}


def rank_main(rank: int, world_size: int, init_method: str, config: EngineConfig,
              conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    comm = None
    try:
        from shoal.engine import Engine
        info = ParallelInfo(rank, world_size, tp_size=world_size, dp_size=1, mode="tp")
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        comm = Comm(info, backend, init_method)
        if config.device.startswith("cuda"):
            config = _with_device(config, f"cuda:{rank}")
        engine = Engine(config, info, comm)
        conn.send(("ready", rank, engine.info))
        _serve(rank, engine, comm, conn)
        conn.send(("stopped", rank, None))
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
    while True:
        num_loops += 1
        new, shutdown, want_stats = [], 0, 0
        if rank == 0:
            timeout = 0.0 if engine.has_work else IDLE_WAIT_SECONDS
            while conn.poll(timeout):
                kind, payload = conn.recv()
                timeout = 0.0
                if kind == "add":
                    new.append(payload)
                elif kind == "stats":
                    want_stats = 1
                elif kind == "shutdown":
                    shutdown = 1
                    break
        control = comm.all_gather_ints([len(new), shutdown, want_stats])[0]  # the driver's
        if control[0]:
            new = comm.broadcast_object(new if rank == 0 else None, src=0)
        for spec in new:
            engine.add_request(**spec)
        if control[2]:
            conn.send(("stats", rank, {**engine.stats(), "rank_loop_iterations": num_loops,
                                       "control_broadcasts": comm.num_broadcasts,
                                       "data_collectives": comm.num_data_collectives}))
        if control[1]:
            engine.shutdown()
            return
        if engine.has_work:
            finished = engine.step()
            if rank == 0 and finished:
                conn.send(("done", rank, [output_record(r) for r in finished]))


def _with_device(config: EngineConfig, device: str) -> EngineConfig:
    from dataclasses import replace
    return replace(config, device=device)
