"""A connector under tensor parallelism: rank 0 decides, every rank moves its shard.

Every TP rank runs the same scheduler over the same requests, so each keeps the engine's
own bookkeeping (pins, save episodes, load plans) and allocates the same block ids. The
connector's scheduler side runs on rank 0 only: each of its answers (pool matches, the
step's plan, whether a finished request still saves) is broadcast on the control group,
so all ranks admit, load and save alike. Every rank has a worker that moves its shard of
each block (pool keys include the shard). A transfer is finished only when every rank's
worker has reported it: the ranks agree on each poll with one element-wise-minimum
all-reduce (issued on the executing thread, only while transfers are pending), and a
failed load counts from the first bad block on any rank, so no rank loads what another
recomputes. Deadlines are agreed the same way: a transfer expired on any rank is aborted
(or fatal) on all. A failure in rank 0's scheduler side travels with its broadcast answer
and becomes every rank's failure; a worker's failure is voted at the next control step.
"""

from __future__ import annotations

import math
import time

from shoal.kv.block_pool import BlockPool
from shoal.connectors.base import ConnectorConfig, ConnectorContext, KVCacheRegistration
from shoal.engine.transfers import ConnectorManager, TransferReport
from shoal.parallel.comm import Comm

NO_FAILURE = 1 << 62  # "no failed block" in the agreed minimum


class TpConnectorManager(ConnectorManager):
    def __init__(self, config: ConnectorConfig, ctx: ConnectorContext,
                 registration: KVCacheRegistration, pool: BlockPool, comm: Comm):
        super().__init__(config, ctx, registration, pool, lead=ctx.rank == 0)
        self.comm = comm
        self._saved: dict[str, int] = {}  # rid -> save episode this rank's worker finished
        self._loaded: set[str] = set()  # loads this rank's worker finished
        self._failed: dict[str, int] = {}  # ... of which failed, from this block index on

    def _ask(self, hook: str, *args):
        """Rank 0 asks (a failure there becomes every rank's failure); all get its answer."""
        answer = (super()._ask(hook, *args), self.failure) if self.scheduler is not None else None
        value, failure = self.comm.broadcast_object(answer, src=0)
        if failure is not None and self.failure is None:
            self.failure = failure
        return value

    def _poll(self, save_epochs: dict[str, int], loading_ids: list[str],
              deadlines: dict[str, float]) -> tuple[TransferReport, list[str]]:
        """Every rank's poll, agreed: done where all are done, expired where any expired."""
        ask_save = [rid for rid, epoch in save_epochs.items() if self._saved.get(rid) != epoch]
        ask_load = [rid for rid in loading_ids if rid not in self._loaded]
        answer = self._work("get_finished", ask_save, ask_load)
        saved, loaded = answer if answer is not None else ((), ())
        for rid in saved:
            self._saved[rid] = save_epochs[rid]
        self._loaded.update(loaded)
        self._failed.update(self._work("get_failed_loads") or {})
        save_ids, pending = list(save_epochs), [*save_epochs, *loading_ids]
        now = time.monotonic()
        flags = ([int(self._saved.get(rid) == save_epochs[rid]) for rid in save_ids]
                 + [int(rid in self._loaded) for rid in loading_ids]
                 + [self._failed.get(rid, NO_FAILURE) for rid in loading_ids]
                 + [int(deadlines.get(rid, math.inf) >= now) for rid in pending])
        if not flags:  # the same on every rank: nothing pending, nothing to agree on
            return TransferReport(), []
        agreed = self.comm.all_reduce_min_ints(flags)
        n, m = len(save_ids), len(loading_ids)
        report = TransferReport()
        for rid, done in zip(save_ids, agreed):
            if done:
                report.finished_saving.add(rid)
                del self._saved[rid]
        for i, rid in enumerate(loading_ids):
            if agreed[n + i]:
                report.finished_loading.add(rid)
                self._loaded.discard(rid)
                self._failed.pop(rid, None)
                if agreed[n + m + i] != NO_FAILURE:
                    report.failed_loads[rid] = agreed[n + m + i]
        live = agreed[n + 2 * m:]
        expired = [rid for rid, ok in zip(pending, live) if not ok
                   and rid not in report.finished_saving and rid not in report.finished_loading]
        return report, list(dict.fromkeys(expired))
