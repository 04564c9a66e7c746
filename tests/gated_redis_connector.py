"""The redis connector with loads held at a gate (in-process engines only): a load task
sets HELD and waits for GATE before it reads anything, so a test can act (stop the
store) while a load is certainly in flight. No timing is involved."""

from __future__ import annotations

import threading

from shoal.connectors.redis.connector import RedisPoolScheduler, RedisPoolWorker

__all__ = ["GATE", "HELD", "GatedRedisWorker", "RedisPoolScheduler"]

GATE = threading.Event()
HELD = threading.Event()


class GatedRedisWorker(RedisPoolWorker):
    def _load_blocks(self, transfers, queue):
        HELD.set()
        GATE.wait(120)
        super()._load_blocks(transfers, queue)
