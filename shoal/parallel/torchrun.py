"""`shoal generate` under torchrun: every process is a rank, rank 0 prints the results.

    torchrun --nproc-per-node 2 -m shoal generate --tp 2 --prompt "..." --max-tokens 32
    torchrun --nproc-per-node 2 -m shoal generate --dp 2 --prompt "..." --prompt "..."

(across machines: `--nnodes N --node-rank I --master-addr HOST --master-port PORT`).
Every rank parses the same arguments and runs the same rank loop as a spawned fleet
(shoal.parallel.rank), with the request list as its inbox. TP: every rank takes every
request (the same list on every rank: nothing is broadcast). ADP: request i belongs to
owner i % world_size. The run ends when the requests are taken and no rank has work; rank
0 then collects the results.
"""

from __future__ import annotations

import os

from shoal.config import EngineConfig
from shoal.request import NewRequest, RequestOutput


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def run_requests(config: EngineConfig, requests: list[NewRequest]
                 ) -> tuple[list[RequestOutput] | None, dict]:
    """Run `requests` across the torchrun ranks; returns (outputs in the order given, stats)
    on rank 0 and (None, stats) elsewhere."""
    from shoal.engine.engine import Engine
    from shoal.parallel.rank import (CollectOutbox, ListInbox, exit_fatal, join_group,
                                     make_policy, serve)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mode = "tp" if config.tp_size > 1 else "adp"
    size = config.tp_size if mode == "tp" else config.dp_size
    if size != world:
        raise ValueError(f"{'tp_size' if mode == 'tp' else 'dp_size'}={size} but torchrun "
                         f"started {world} processes")
    named = [NewRequest(r.prompt_token_ids, r.sampling, f"req-{i}", r.prompt, r.cache_salt)
             for i, r in enumerate(requests)]
    mine = named if mode == "tp" else named[rank::world]
    peers, comm, config = join_group(rank, world, mode, config, "env://",
                                     int(os.environ.get("LOCAL_RANK", rank)))
    try:
        engine = Engine(config, peers, on_stuck=lambda message: exit_fatal(rank, message))
        outbox = CollectOutbox(rank)
        serve(engine, make_policy(peers, comm), ListInbox(mine, is_replicated=mode == "tp"),
              outbox)
        finished = outbox.collected.finished  # TP: rank 0 has every request
        if mode == "adp":  # each owner has its own
            finished = [o for part in comm.all_gather_object(finished) for o in part]
        stats = engine.stats()
    finally:
        comm.shutdown()
    if rank != 0:
        return None, stats
    by_id = {o.request_id: o for o in finished}
    return [by_id[r.request_id] for r in named], stats
