"""Comm: the process group's lifetime."""

from __future__ import annotations

import multiprocessing as mp
import os

from shoal.parallel.comm import Comm
from shoal.parallel.fleet import free_port


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(rank: int, port: int, results) -> None:
    import torch
    torch.ones(256, 256).sum()  # torch's own thread pool starts before the count
    before = _threads()
    comm = Comm(rank, 2, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=60)
    during = _threads()
    gathered = comm.all_gather_object(rank)
    comm.shutdown()
    results.put((rank, before, during, _threads(), gathered))


def test_shutdown_ends_the_group_threads_before_exit():
    # A gloo worker still alive when the interpreter finalizes may drop a collective's
    # tensors then, and abort the process (it cannot take the GIL any more): shutdown must
    # leave no worker behind.
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, before, during, after, gathered in got:
        assert gathered == [0, 1]
        assert during > before  # the groups run threads of their own...
        assert after == before, f"rank {rank}: {after - before} group threads outlive shutdown"
