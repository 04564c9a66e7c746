"""The process group: the only module that calls torch.distributed.

Ranks are processes; gloo on CPU, NCCL on CUDA. Addresses come from the launcher
(`init_method`, e.g. tcp://127.0.0.1:PORT from a locally spawned fleet, or env:// under
torchrun). Every collective the engine issues goes through `Comm`, which counts them.
"""

from __future__ import annotations

import datetime
import gc
import time

import torch
import torch.distributed as dist


class Comm:
    """Collectives over one process group (a no-op world of one when not initialised)."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: str | None = None,
                 init_method: str | None = None, timeout_s: float = 600.0):
        self.rank = rank
        self.world_size = world_size
        self.num_control_collectives = 0  # per-step gathers and request broadcasts
        self.num_broadcasts = 0  # of which request broadcasts
        self.num_data_collectives = 0  # all-reduces inside the forward
        self.control_seconds = 0.0  # wall time spent in control collectives
        self._control = None
        self._transfers = None
        if world_size > 1:
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timeout)
            # Control messages travel on their own (CPU) group: the overlap loop issues them
            # on the scheduling thread while the forward's all-reduces run on another thread,
            # and collectives of one group must be issued in the same order on every rank.
            self._control = dist.new_group(backend="gloo", timeout=timeout)
            # TP transfer reports are agreed on the thread that runs the forward (the
            # overlap loop's scheduling thread owns the control group meanwhile)
            self._transfers = dist.new_group(backend="gloo", timeout=timeout)

    def counters(self) -> dict[str, float]:
        """Control-collective counters, as Engine.stats() reports them."""
        return {"control_collectives": self.num_control_collectives,
                "control_seconds": self.control_seconds}

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over all ranks (the row-parallel layers' partial outputs)."""
        if self.world_size > 1:
            self.num_data_collectives += 1
            dist.all_reduce(t)
        return t

    def all_gather_(self, t: torch.Tensor) -> torch.Tensor:
        """Equal-shaped tensors of all ranks, concatenated along dim 0 in rank order."""
        if self.world_size == 1:
            return t
        self.num_data_collectives += 1
        t = t.contiguous()
        if dist.get_backend() == "nccl":
            out = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                              device=t.device)
            dist.all_gather_into_tensor(out, t)
            return out
        parts = [torch.empty_like(t) for _ in range(self.world_size)]  # gloo: list form
        dist.all_gather(parts, t)
        return torch.cat(parts)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """The per-step control message: a fixed-size int64 vector from every rank."""
        if self.world_size == 1:
            return [list(values)]
        self.num_control_collectives += 1
        start = time.perf_counter()
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._control)
        self.control_seconds += time.perf_counter() - start
        return [t.tolist() for t in out]

    def all_reduce_min_ints(self, values: list[int]) -> list[int]:
        """Element-wise minimum over all ranks (TP: a transfer is done only where every rank's
        flag is 1). Issued from the executing thread, on its own group."""
        if self.world_size == 1:
            return list(values)
        self.num_control_collectives += 1
        start = time.perf_counter()
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._transfers)
        self.control_seconds += time.perf_counter() - start
        return t.tolist()

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s object on every rank (new requests, TP connector answers and plans:
        trusted, in-job traffic only)."""
        if self.world_size == 1:
            return obj
        self.num_control_collectives += 1
        self.num_broadcasts += 1
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._control)
        return box[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's object (end-of-run results under torchrun: trusted, in-job only)."""
        if self.world_size == 1:
            return [obj]
        self.num_control_collectives += 1
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._control)
        return out

    def shutdown(self) -> None:
        """Leave the group and end its threads while Python still runs: a gloo worker that
        drops a finished collective's tensors after the interpreter began finalizing can
        take the GIL no more, and aborts the process ("terminate called without an active
        exception"). The groups' last references go here, so their destructors (which wait
        for the workers, the GIL released) run now."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self._control = self._transfers = None
        gc.collect()
