"""One pool block as every store keeps it: a 128-byte header, then the raw payload.

Header (little-endian): magic "SHOALKV\\0", format version, header size, dtype code,
ndim, shape (6 x u32), payload byte length, xxh3-64 of the payload, namespace (32 B),
key (32 B), crc32 of everything before it. Nothing is unpickled; every field is checked
against what the reader expects (`check_header`), and any mismatch is a miss (never
loaded as KV). The fs pool keeps a block as a file, the redis pool as one value; both
are these bytes.

Checksum choice (measured here, 47 MB buffer): xxh3-64 26.8 GB/s, xxh64 18.4, crc32 6.2,
blake2b 1.3. At the ~6 GB/s of a page-cache read, xxh3 costs ~20% of the read time. It is
computed by xxhash's own C function called through ctypes, which releases the GIL, so the
I/O threads verify blocks in parallel (the `xxhash` module's functions hold the GIL); its
runtime-dispatched entry (AVX2/AVX-512) hashes a 720 KiB block at 52 GB/s here.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"SHOALKV\0"
FORMAT_VERSION = 1
HEADER_SIZE = 128
MAX_DIMS = 6
_FIELDS = struct.Struct(f"<8sHHBB2x{MAX_DIMS}IQQ32s32s")
_CRC = struct.Struct("<I")
assert _FIELDS.size + _CRC.size <= HEADER_SIZE
# by the dtype's name (str of a torch.dtype): no torch here, so the pool's read processes
# (fs/read_procs.py) import this module without it
DTYPE_CODES = {"torch.float32": 1, "torch.float16": 2, "torch.bfloat16": 3}
_ITEMSIZE = {1: 4, 2: 2, 3: 2}
# no block is larger: a 405B model's block of 16 tokens in bf16 is 8 MiB, of 256 tokens
# 128 MiB; a header claiming more is damage (or a planted sparse file), never read
MAX_PAYLOAD_BYTES = 1 << 30


class BlockMissing(Exception):
    """No usable block under this key (a plain miss)."""


class CorruptBlock(Exception):
    """A block exists but fails verification; `reason` is a short word for stats and names."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockHeader:
    dtype_code: int
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    namespace: bytes
    key: bytes


def _native_xxh3():
    """XXH3-64 from the xxhash extension itself (same code, same value), called through
    ctypes so the GIL is released; None if no symbol is there or agrees. The extension's
    runtime-dispatched entry (AVX2/AVX-512 where the CPU has them) comes first: on 720 KiB
    blocks it hashed at 52 GB/s here against 28 for the baseline build."""
    try:
        import xxhash._xxhash as ext
        lib = ctypes.CDLL(ext.__file__)
    except (ImportError, OSError):
        return None
    probe = np.arange(1 << 12, dtype=np.uint8)
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
        if fn(probe.ctypes.data, probe.nbytes) == xxhash.xxh3_64_intdigest(probe):
            return fn
    return None


_XXH3 = _native_xxh3()
_NATIVE_MIN_BYTES = 1 << 14  # below this the call's overhead outweighs the GIL it frees


def checksum(payload) -> int:
    """xxh3-64 of a bytes-like object (bytes, memoryview, a contiguous buffer)."""
    arr = np.frombuffer(payload, dtype=np.uint8)
    if _XXH3 is None or arr.nbytes < _NATIVE_MIN_BYTES:
        return xxhash.xxh3_64_intdigest(arr)
    return _XXH3(arr.ctypes.data, arr.nbytes)


def dtype_code(dtype) -> int:
    """The header's code of a torch.dtype (or its name)."""
    return DTYPE_CODES[str(dtype)]


def encode_header(namespace: bytes, key: bytes, shape: tuple[int, ...], dtype,
                  payload_len: int, payload_checksum: int) -> bytes:
    assert len(shape) <= MAX_DIMS, shape
    dims = list(shape) + [0] * (MAX_DIMS - len(shape))
    body = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, dtype_code(dtype), len(shape),
                        *dims, payload_len, payload_checksum, namespace, key)
    body += _CRC.pack(zlib.crc32(body))
    return body + b"\0" * (HEADER_SIZE - len(body))


def parse_header(buf: bytes) -> BlockHeader:
    """Strict: any unexpected byte raises CorruptBlock."""
    if len(buf) < HEADER_SIZE:
        raise CorruptBlock("truncated", f"header of {len(buf)} bytes")
    (magic, version, header_size, dtype_code, ndim, *rest) = _FIELDS.unpack_from(buf)
    dims, (payload_len, payload_checksum, namespace, key) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if magic != MAGIC:
        raise CorruptBlock("garbage", "bad magic")
    (crc,) = _CRC.unpack_from(buf, _FIELDS.size)
    if crc != zlib.crc32(buf[:_FIELDS.size]):
        raise CorruptBlock("header", "header checksum mismatch")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise CorruptBlock("version", f"format {version}, header {header_size}")
    if any(buf[_FIELDS.size + _CRC.size:HEADER_SIZE]):
        raise CorruptBlock("header", "non-zero padding")
    if not 0 < ndim <= MAX_DIMS or any(dims[ndim:]):
        raise CorruptBlock("header", f"ndim {ndim}")
    return BlockHeader(dtype_code, tuple(dims[:ndim]), payload_len, payload_checksum,
                       namespace, key)


def check_payload_size(header: BlockHeader) -> None:
    """CorruptBlock unless the header's payload length is what its shape and dtype make,
    and no more than any block can be (the pool tools check this before reading)."""
    itemsize = _ITEMSIZE.get(header.dtype_code)
    if itemsize is None:
        raise CorruptBlock("header", f"dtype code {header.dtype_code}")
    expected = itemsize
    for dim in header.shape:
        expected *= dim
    if header.payload_len != expected or header.payload_len > MAX_PAYLOAD_BYTES:
        raise CorruptBlock("length", f"payload of {header.payload_len} bytes for shape "
                           f"{header.shape} (at most {MAX_PAYLOAD_BYTES} for any block)")


def check_header(header: BlockHeader, namespace: bytes, key: bytes, shape: tuple[int, ...],
                 dtype, payload_len: int) -> None:
    """CorruptBlock unless the header describes this block: our namespace (a foreign model's
    block under the same key is a miss), this key, this shape and dtype, this length."""
    if header.namespace != namespace:
        raise CorruptBlock("namespace", "written by another model/layout")
    if header.key != key:
        raise CorruptBlock("key", "header key differs from the block's key")
    if header.dtype_code != dtype_code(dtype) or header.shape != tuple(shape):
        raise CorruptBlock("shape", f"{header.shape}/{header.dtype_code}")
    if header.payload_len != payload_len:
        raise CorruptBlock("length", f"{header.payload_len} != {payload_len}")
