"""`shoal generate` under torchrun: every process is a rank, rank 0 prints the results.

    torchrun --nproc-per-node 2 -m shoal generate --tp 2 --prompt "..." --max-tokens 32

(across machines: `--nnodes N --node-rank I --master-addr HOST --master-port PORT`).
Every rank parses the same arguments, so every rank adds the same requests in the same
order before the first step; then the ranks step in lockstep, one control all-gather
per step deciding whether anyone still has work.
"""

from __future__ import annotations

import os

from shoal.config import EngineConfig
from shoal.parallel.comm import Comm, ParallelInfo


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def run_requests(config: EngineConfig, requests: list[dict]):
    """Run `requests` (add_request kwargs) on this rank; returns (finished requests in the
    order given, stats) on rank 0 and (None, stats) elsewhere."""
    from dataclasses import replace

    from shoal.engine import Engine

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if config.tp_size != world:
        raise ValueError(f"tp_size={config.tp_size} but torchrun started {world} processes")
    info = ParallelInfo(rank, world, tp_size=world, dp_size=1, mode="tp")
    cuda = config.device.startswith("cuda")
    if cuda:
        config = replace(config, device=f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}")
    comm = Comm(info, "nccl" if cuda else "gloo", "env://")
    try:
        engine = Engine(config, info, comm)
        reqs = [engine.add_request(**r) for r in requests]
        while any(flag for (flag,) in comm.all_gather_ints([int(engine.has_work)])):
            engine.step()
        stats = engine.stats()
        engine.shutdown()
    finally:
        comm.shutdown()
    return (reqs if rank == 0 else None), stats
