"""A GGUF file's header (metadata and tensor table) and its tensors, read straight from a
memory map.

The `gguf` package's reader builds a numpy view per element of every metadata array, so a
tokenizer's vocabulary (100k strings for SmolLM2) takes it seconds; this parser walks the
header once with `struct` and keeps only offsets for the tensors. Layout (little-endian,
versions 2 and 3):

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata: key (string), value type u32, value   (string: u64 length + UTF-8 bytes;
              array: element type u32, count u64, elements)
    tensor infos: name, dims u32, shape u64 x dims (fastest first), ggml type u32,
              offset u64 (from the data section)
    data section: at the next multiple of general.alignment (32 by default)
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types: struct format of each scalar type (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY = 8, 9


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [blocks, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A block's 32 4-bit values: the 16 low nibbles, then the 16 high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:  # d (f16), 16 bytes: x = d * (q - 8)
    b = raw.view(-1, 18)
    return _scale(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(raw: torch.Tensor) -> torch.Tensor:  # d, m (f16), 16 bytes: x = d * q + m
    b = raw.view(-1, 20)
    return _scale(b, 0) * _nibbles(b[:, 4:]).float() + _scale(b, 2)


def _q8_0(raw: torch.Tensor) -> torch.Tensor:  # d (f16), 32 int8: x = q * d
    b = raw.view(-1, 34)
    return b[:, 2:].contiguous().view(torch.int8).float() * _scale(b, 0)


# ggml types read without the gguf package: F32, F16, Q4_0, Q4_1, Q8_0
_FAST = {0: lambda raw: raw.view(torch.float32), 1: lambda raw: raw.view(torch.float16).float(),
         2: _q4_0, 3: _q4_1, 8: _q8_0}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    ggml_type: int
    offset: int  # in the file
    num_bytes: int

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


class GGUFFile:
    """`fields`: metadata key -> value (arrays as lists); `tensors`: the tensor table in file
    order. ValueError for anything that is not a whole GGUF file of a supported version."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise ValueError(f"{self.path}: not a GGUF file (empty)") from None
        self._pos = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"{self.path}: truncated or corrupt GGUF header ({e})") from None

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes (a read-only view of the map)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=t.num_bytes, offset=t.offset)

    def dequantize(self, t: TensorInfo) -> torch.Tensor:
        """The tensor as float32 in HF's shape (slowest-varying dimension first), a new
        tensor. F32, F16, Q4_0, Q4_1 and Q8_0 on torch's threads (the `gguf` package's
        arithmetic, op for op: the same floats, a few times sooner); other types through the
        `gguf` package."""
        shape = [int(d) for d in reversed(t.shape)]
        fast = _FAST.get(t.ggml_type)
        if fast is not None:
            raw = torch.from_numpy(self.tensor_bytes(t).copy())
            return fast(raw).reshape(shape)
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.tensor_bytes(t), GGMLQuantizationType(t.ggml_type))
        return torch.from_numpy(np.require(w, np.float32, ["C", "W"])).reshape(shape)

    # -- parsing ---------------------------------------------------------------------------

    def _read_header(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._map[:4] != MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        self._pos = 4
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise ValueError(f"{self.path}: a big-endian GGUF file is not supported" if swapped
                             in (2, 3) else f"{self.path}: GGUF version {version} is not "
                             "supported (2 or 3)")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I")[0])
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{num_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, shape, ggml_type, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: GGUF general.alignment {alignment!r} is not a power "
                             "of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, ggml_type, offset in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{self.path}: GGUF tensor {name!r} has an unknown type "
                                 f"{ggml_type}") from None
            num = math.prod(shape)  # Python ints: a corrupt dimension cannot wrap around
            t = TensorInfo(name, tuple(int(d) for d in shape), ggml_type, data_start + offset,
                           num // block * size)
            if num % block or t.offset + t.num_bytes > len(self._map):
                raise ValueError(f"{self.path}: GGUF tensor {name!r} lies outside the file "
                                 "(truncated or corrupt)")
            self.tensors.append(t)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise struct.error(f"a string of {n} bytes runs past the end")
        # (a vocabulary may hold byte sequences that are not UTF-8: kept, not refused)
        s = self._map[self._pos:self._pos + n].decode("utf-8", errors="surrogateescape")
        self._pos += n
        return s

    def _value(self, kind: int):
        if kind in SCALARS:
            return self._unpack("<" + SCALARS[kind])[0]
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            item, count = self._unpack("<IQ")
            if item in SCALARS:  # one unpack for the whole array
                fmt = SCALARS[item]
                if self._pos + count * struct.calcsize(fmt) > len(self._map):
                    raise struct.error(f"an array of {count} items runs past the end")
                return list(self._unpack(f"<{count}{fmt}"))
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata type {kind}")
