"""What an I/O thread of a store-backed worker does with one load unit or one saved block
(the worker's side of the connector contract is worker.py; `StoreWorker` takes these
methods from `UnitIO`). A unit's blocks are read straight into the KV cache's memory (a
CPU cache without a tier) or into tier pages that the mover copies into the cache
(paged_io.py), by the I/O thread itself or, where the store runs read processes
(fs/read_procs.py), by one of them in one call per chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shoal.connectors.store.base import UnitReader
from shoal.connectors.store.block_format import BlockMissing, CorruptBlock
from shoal.connectors.store.load_queue import LoadQueue
from shoal.connectors.store.scheduler import BlockTransfer

log = logging.getLogger(__name__)


class UnitIO:
    """The I/O threads' work of a StoreWorker (whose attributes it uses)."""

    def _load_blocks(self, transfers: list[BlockTransfer], queue: LoadQueue) -> None:
        """Load one unit; once its request is aborted, the blocks not read yet are skipped."""
        start = time.perf_counter()
        reader = self.store.read_unit([self._key(t) for t in transfers], self.spec)
        if self._mover is None:  # block by block, each landing as it is read
            ok = sum(self._read_own_block(t, reader, j, queue) for j, t in enumerate(transfers))
        else:  # through pages: blocks not read came from the tier
            failed = []

            def read(i: int, dest: memoryview) -> int | None:
                if queue.is_aborted:
                    failed.append(i)
                    return None
                if self._throttle is not None:
                    self._throttle.wait(self.layout.block_nbytes)
                checksum = self._read_block(transfers[i], lambda: reader.read_into(
                    i, dest, not self._mover.verifies))
                if checksum is None:
                    failed.append(i)
                return checksum

            def read_many(indices: list[int], page: int, first: int) -> list[int | None] | None:
                """A chunk's blocks in one call to a read process, where one takes them
                (None: the load is aborted, or no process took them: `read` each)."""
                answers = None if queue.is_aborted else self.store.read_rows(
                    [self._key(transfers[i]) for i in indices], self.tier.row(page, first),
                    not self._mover.verifies)
                if answers is None:
                    return None
                sums = [self._read_block(transfers[i], lambda a=a: _settle(a))
                        for i, a in zip(indices, answers)]
                failed.extend(i for i, c in zip(indices, sums) if c is None)
                return sums

            def corrupt(i: int) -> None:  # failed the GPU's verification
                failed.append(i)
                self._corrupt(transfers[i], CorruptBlock("checksum", "payload checksum mismatch"))
            self._mover.load([self._key(t) for t in transfers], [t.block_id for t in transfers],
                             read, corrupt, queue.after, read_many)
            ok = len(transfers) - len(failed)
        with self._lock:
            self._stats["bytes_loaded"] += ok * self.layout.block_nbytes
            self._stats["blocks_loaded"] += ok
            self._stats["load_seconds"] += time.perf_counter() - start

    def _read_own_block(self, t: BlockTransfer, reader: UnitReader, i: int,
                        queue: LoadQueue) -> bool:
        """Read block `t` straight into its place, unless the engine dropped it (before or
        while the read waited for its turn); True if it landed."""
        if queue.is_aborted or not queue.wants(t):
            return False
        if self._throttle is not None and not queue.wait_turn(
                t, self._throttle.reserve(self.layout.block_nbytes)):
            return False  # dropped while it waited for its turn
        if not queue.claim(t):  # dropped just now
            return False
        try:
            return self._read_block(t, lambda: reader.read_into(
                i, self._block_bytes[t.block_id])) is not None
        finally:
            queue.land(t)

    def _read_block(self, t: BlockTransfer, read: Callable[[], int]) -> int | None:
        """Block `t`'s read (`read`: UnitReader.read_into's call, or a read process's
        answer): the header's checksum of the payload, or None (the failure recorded, a
        corrupt block set aside) if it is missing, unreadable or fails."""
        try:
            return read()
        except BlockMissing:
            self._record_failure(t, "missing_blocks")
        except CorruptBlock as e:
            self._corrupt(t, e)
        except OSError as e:  # unreadable, or the store cannot be reached
            log.warning("pool block %s could not be read: %s", self._key(t).hex(), e)
            self._record_failure(t, "missing_blocks")
        return None

    def _corrupt(self, t: BlockTransfer, error: CorruptBlock) -> None:
        """Block `t` failed verification: set aside, the failure recorded."""
        self.store.set_aside(self._key(t), error)
        self._record_failure(t, "corrupt_blocks")

    def _record_failure(self, t: BlockTransfer, counter: str) -> None:
        with self._lock:
            self._stats[counter] += 1
            self._bad_blocks.setdefault(t.request_id, []).append(t.block_index)

    def _save_block(self, t: BlockTransfer, payload: memoryview) -> bool:
        """Publish one block from `payload`; True if the pool has it now."""
        start = time.perf_counter()
        key = self._key(t)
        try:
            written = self.store.write(key, payload, self.spec)
        except OSError as e:
            log.warning("pool save of block %s failed: %s", key.hex(), e)
            with self._lock:
                self._stats["save_failures"] += 1
            return False
        with self._lock:
            self._stats["save_seconds"] += time.perf_counter() - start
            if written:
                self._stats["bytes_saved"] += payload.nbytes
                self._stats["blocks_saved"] += 1
        return True


def _settle(answer: int | Exception) -> int:
    """A read process's answer for a block: its checksum, or the read's error raised."""
    if isinstance(answer, Exception):
        raise answer
    return answer
