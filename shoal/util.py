"""Small helpers every layer may use."""

from __future__ import annotations

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
