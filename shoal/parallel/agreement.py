"""How TP ranks agree on their connector: rank 0 decides, every rank moves its shard.

Every TP rank runs the same scheduler over the same requests, so each keeps the engine's
own transfer bookkeeping (pins, save episodes, loads) and allocates the same block ids.
The connector's scheduler side runs on rank 0 only: each of its answers (pool matches,
the step's plan, whether a finished request still saves) is broadcast, with rank 0's
failure if it has one, so all ranks admit, load, save and fail alike. Every rank has a
worker that moves its shard of each block (pool keys include the shard). A transfer is
finished only when every rank's worker has reported it: the ranks agree on each poll with
one element-wise-minimum all-reduce (issued on the executing thread, only while transfers
are pending), so a failed load counts from the first bad block on any rank and a deadline
expired on any rank is expired on all. A worker's failure is voted at the next control
step of the rank loop.
"""

from __future__ import annotations

from typing import Any

from shoal.parallel.comm import Comm


class TpAgreement:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.is_lead = comm.rank == 0

    def share(self, answer: Any) -> Any:
        return self.comm.broadcast_object(answer, src=0)

    def agree_min(self, flags: list[int]) -> list[int]:
        return self.comm.all_reduce_min_ints(flags)
