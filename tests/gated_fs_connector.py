"""The fs connector with loads held at a gate (for tests across rank processes).

Rank processes inherit SHOAL_TEST_LOAD_GATE, the path of a FIFO: each load task opens it
for reading, which blocks until the test opens the write end. No timing is involved: the
test decides when loads may proceed.
"""

from __future__ import annotations

import os
import threading

from shoal.connectors.fs.connector import FsPoolScheduler, FsPoolWorker

__all__ = ["BackLastFsWorker", "FsPoolScheduler", "GatedFsWorker"]


class GatedFsWorker(FsPoolWorker):
    def _load_blocks(self, transfers, queue):
        gate = os.environ.get("SHOAL_TEST_LOAD_GATE")
        if gate:
            with open(gate, "rb"):
                pass
        super()._load_blocks(transfers, queue)


class BackLastFsWorker(FsPoolWorker):
    """Lands a load's units out of order, in one process: the unit holding the load's last
    block (the first unit read) waits until every other unit has landed and the engine
    has polled that (`get_load_progress`: blocks below the back unit free, none landed
    from the end)."""

    def _load_units(self, transfers):
        units = super()._load_units(transfers)
        self._back = units[0]
        self._back_from = min(t.block_index for t in units[0])
        self._seen = threading.Event()
        return units

    def _load_blocks(self, transfers, queue):
        if transfers is self._back:
            assert self._seen.wait(60), "the engine never polled the other units landed"
        super()._load_blocks(transfers, queue)

    def get_load_progress(self, loading_ids):
        progress = super().get_load_progress(loading_ids)
        if any(p.writes_from == self._back_from for p in progress.values()):
            self._seen.set()
        return progress
