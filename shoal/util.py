"""Small helpers every layer may use."""

from __future__ import annotations

import atexit
import gc
import sys

import torch


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (blocks for a number of tokens)."""
    return -(-a // b)


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the device: on a GPU
    it goes through pinned memory with an asynchronous copy (`torch.tensor(list,
    device="cuda")` copies from pageable memory and waits for the stream to drain, which
    stops the host from launching ahead of the device)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor on its way to the host: on a GPU the copy is queued on the current
    stream behind the work that produces it; `tolist()` waits for that copy only (any
    thread may call it; the GIL is released meanwhile)."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._host = tensor
        self._list: list | None = None

    def tolist(self) -> list:
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list


class HostBuffers:
    """Two int32 host buffers (pinned for a GPU) used in turn for host-to-device copies:
    `take()` returns the next one once the copy last sent from it has run; `sent()` marks
    the copy from it just queued."""

    def __init__(self, size: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.size = size
        self._buffers = [torch.zeros(size, dtype=torch.int32, pin_memory=self.cuda)
                         for _ in range(2)]
        # an event not yet recorded counts as done: synchronize() returns at once
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self._turn = 0

    def take(self) -> torch.Tensor:
        self._turn ^= 1
        if self._events is not None:
            self._events[self._turn].synchronize()
        return self._buffers[self._turn]

    def sent(self) -> None:
        if self._events is not None:
            self._events[self._turn].record()


GPU_GIL_SWITCH_SECONDS = 100e-6


def hand_over_the_gil_often() -> None:
    """A GPU engine's host threads (the forward thread of the overlap loop, the pool's I/O
    threads) each hold the GIL briefly between waits that release it; with Python's default
    5 ms switch interval one that wants the GIL back after a wait (a step's tokens arrived,
    a copy ended) can wait up to 5 ms behind a thread running Python, which would be most
    of a decode step. A process running a GPU engine is a server: set for the process."""
    if sys.getswitchinterval() > GPU_GIL_SWITCH_SECONDS:
        sys.setswitchinterval(GPU_GIL_SWITCH_SECONDS)


def freeze_what_was_built() -> None:
    """Collect, then move every object alive now (the model, torch's and the other
    libraries' modules: hundreds of thousands) out of the cyclic collector's reach: the
    collections a step's short-lived objects set off would otherwise scan them all (two
    such passes took 0.46 s of a 0.67 s batch of 256 on a 2-core machine). Unfrozen at
    exit (below), so the interpreter's last collection still finalizes them: Triton's
    bindings report objects left alive then as leaks."""
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)  # a no-op when nothing was frozen
