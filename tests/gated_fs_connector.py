"""The fs connector with loads held at a gate (for tests across rank processes).

Rank processes inherit SHOAL_TEST_LOAD_GATE, the path of a FIFO: each load task opens it
for reading, which blocks until the test opens the write end. No timing is involved: the
test decides when loads may proceed.
"""

from __future__ import annotations

import os

from shoal.connectors.fs.connector import FsPoolScheduler, FsPoolWorker

__all__ = ["FsPoolScheduler", "GatedFsWorker"]


class GatedFsWorker(FsPoolWorker):
    def _load_blocks(self, transfers, queue):
        gate = os.environ.get("SHOAL_TEST_LOAD_GATE")
        if gate:
            with open(gate, "rb"):
                pass
        super()._load_blocks(transfers, queue)
