"""`shoal generate` under torchrun: every process is a rank, rank 0 prints the results.

    torchrun --nproc-per-node 2 -m shoal generate --tp 2 --prompt "..." --max-tokens 32
    torchrun --nproc-per-node 2 -m shoal generate --dp 2 --prompt "..." --prompt "..."

(across machines: `--nnodes N --node-rank I --master-addr HOST --master-port PORT`).
Every rank parses the same arguments. TP: every rank adds every request, in the same
order, before the first step; the ranks then step in lockstep, one control all-gather per
step deciding whether anyone still has work. ADP: request i belongs to owner
i % world_size; every owner steps until the step's all-gather says nobody has work;
rank 0 collects the owners' results at the end.
"""

from __future__ import annotations

import os

from shoal.config import EngineConfig


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def run_requests(config: EngineConfig, requests: list[dict]):
    """Run `requests` (add_request kwargs) across the torchrun ranks; returns (finished
    requests in the order given, stats) on rank 0 and (None, stats) elsewhere."""
    from shoal.engine.engine import Engine
    from shoal.parallel.rank import (_FleetState, _step, agree_on_failure, apply_record,
                                     join_group, on_stuck_exit, output_record)
    from shoal.request import Request

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mode = "tp" if config.tp_size > 1 else "adp"
    size = config.tp_size if mode == "tp" else config.dp_size
    if size != world:
        raise ValueError(f"{'tp_size' if mode == 'tp' else 'dp_size'}={size} but torchrun "
                         f"started {world} processes")
    info, comm, config = join_group(rank, world, mode, config, "env://",
                                    int(os.environ.get("LOCAL_RANK", rank)))
    try:
        if mode == "tp":
            engine = Engine(config, info, comm)
            on_stuck_exit(engine, rank)
            reqs = [engine.add_request(**r) for r in requests]
            while True:  # one control all-gather per step: anyone working? anyone failed?
                failure = engine.failure
                rows = comm.all_gather_ints([int(engine.has_work), int(failure is not None)])
                agree_on_failure(comm, [r[1] for r in rows], failure)
                if not any(r[0] for r in rows):
                    break
                _step(engine)
        else:
            fleet = _FleetState(comm)
            engine = Engine(config, info, comm, fleet_sync=fleet.sync)
            on_stuck_exit(engine, rank)
            mine = {i: engine.add_request(**r, request_id=f"req-{i}")
                    for i, r in enumerate(requests) if i % world == rank}
            while True:
                engine.step()
                if not fleet.any_work:
                    break
            parts = comm.all_gather_object({i: output_record(r) for i, r in mine.items()})
            records = {i: rec for part in parts for i, rec in part.items()}
            reqs = [apply_record(Request(f"req-{i}", list(r["prompt_token_ids"]), r["sampling"],
                                         frozenset(), prompt=r.get("prompt")), records[i])
                    for i, r in enumerate(requests)]
        stats = engine.stats()
        engine.shutdown()
    finally:
        comm.shutdown()
    return (reqs if rank == 0 else None), stats
