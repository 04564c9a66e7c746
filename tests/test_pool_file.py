"""Pool file format: strict headers, atomic publish under concurrent writers and readers."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.connectors.fs import format as pf

NS = b"n" * 32
SHAPE = (2, 2, 4, 1, 64)  # 4 KiB of float32
NBYTES = 2 * 2 * 4 * 64 * 4


def payload(key: bytes, writer: int) -> bytearray:
    # writers disagree on the bytes: whoever publishes first must win intact
    return bytearray(np.full(NBYTES // 4, float(writer), dtype=np.float32).tobytes())


def writer_proc(root: str, keys: list[bytes], writer: int, go) -> None:
    go.wait()
    for key in keys:
        pf.write_block(Path(root), NS, key, memoryview(payload(key, writer)), SHAPE, torch.float32)


def reader_proc(root: str, keys: list[bytes], go, stop, result) -> None:
    go.wait()
    seen = bad = 0
    dest = bytearray(NBYTES)
    while not stop.is_set() or seen < len(keys):
        seen = 0
        for key in keys:
            try:
                pf.read_block_into(Path(root), NS, key, memoryview(dest), SHAPE, torch.float32)
                seen += 1
            except pf.BlockMissing:
                pass
            except pf.CorruptBlock:
                bad += 1
        if stop.is_set() and seen == len(keys):
            break
    result.put((seen, bad))


def test_concurrent_writers_publish_whole_files_only(tmp_path):
    keys = [os.urandom(32) for _ in range(40)]
    pf.ensure_pool_dirs(tmp_path)
    ctx = mp.get_context("spawn")
    go, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=writer_proc, args=(str(tmp_path), keys, w, go)) for w in range(4)]
    reader = ctx.Process(target=reader_proc, args=(str(tmp_path), keys, go, stop, result))
    for p in (*writers, reader):
        p.start()
    go.set()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    stop.set()
    seen, bad = result.get(timeout=60)
    reader.join(60)
    assert (seen, bad) == (len(keys), 0)  # a concurrent reader never saw a partial file
    dest = bytearray(NBYTES)
    for key in keys:
        pf.read_block_into(tmp_path, NS, key, memoryview(dest), SHAPE, torch.float32)
        values = set(np.frombuffer(bytes(dest), dtype=np.float32).tolist())
        assert len(values) == 1  # one writer's whole payload
    assert [p for p in tmp_path.rglob("*.tmp")] == []


def test_never_overwrites(tmp_path):
    key = os.urandom(32)
    assert pf.write_block(tmp_path, NS, key, memoryview(payload(key, 1)), SHAPE, torch.float32)
    assert not pf.write_block(tmp_path, NS, key, memoryview(payload(key, 2)), SHAPE, torch.float32)
    dest = bytearray(NBYTES)
    pf.read_block_into(tmp_path, NS, key, memoryview(dest), SHAPE, torch.float32)
    assert dest == payload(key, 1)


def test_a_read_left_to_its_caller_to_verify(tmp_path):
    """verify=False (a GPU checks the bytes after its copy): the payload is read and the
    header's checksum returned, corrupt or not; every header field is still checked."""
    key = os.urandom(32)
    data = payload(key, 1)
    pf.write_block(tmp_path, NS, key, memoryview(data), SHAPE, torch.float32)
    path = pf.block_path(tmp_path, key)
    raw = bytearray(path.read_bytes())
    raw[pf.HEADER_SIZE + 100] ^= 0x04
    path.write_bytes(bytes(raw))
    dest = bytearray(NBYTES)
    got = pf.read_block_into(tmp_path, NS, key, memoryview(dest), SHAPE, torch.float32,
                             verify=False)
    assert got == pf.checksum(memoryview(data)) != pf.checksum(memoryview(dest))
    assert dest == raw[pf.HEADER_SIZE:]
    with pytest.raises(pf.CorruptBlock, match="checksum"):
        pf.read_block_into(tmp_path, NS, key, memoryview(dest), SHAPE, torch.float32)
    with pytest.raises(pf.CorruptBlock, match="namespace"):
        pf.read_block_into(tmp_path, b"x" * 32, key, memoryview(dest), SHAPE, torch.float32,
                           verify=False)


@pytest.mark.parametrize("expect, kwargs", [
    ("namespace", dict(namespace=b"x" * 32)), ("shape", dict(shape=(2, 2, 4, 1, 32))),
    ("shape", dict(dtype=torch.float16)), ("length", dict(dest_len=NBYTES - 4)),
])
def test_reader_checks_every_field(tmp_path, expect, kwargs):
    key = os.urandom(32)
    pf.write_block(tmp_path, NS, key, memoryview(payload(key, 1)), SHAPE, torch.float32)
    dest = bytearray(kwargs.get("dest_len", NBYTES))
    with pytest.raises(pf.CorruptBlock) as e:
        pf.read_block_into(tmp_path, kwargs.get("namespace", NS), key, memoryview(dest),
                           kwargs.get("shape", SHAPE), kwargs.get("dtype", torch.float32))
    assert e.value.reason == expect


def test_header_roundtrip_and_strictness():
    h = pf.encode_header(NS, b"k" * 32, SHAPE, torch.float32, NBYTES, 1234)
    assert len(h) == pf.HEADER_SIZE
    parsed = pf.parse_header(h)
    assert (parsed.shape, parsed.payload_len, parsed.checksum) == (SHAPE, NBYTES, 1234)
    for i in (0, 9, 30, 100, 127):
        broken = bytearray(h)
        broken[i] ^= 0xFF
        with pytest.raises(pf.CorruptBlock):
            pf.parse_header(bytes(broken))


@pytest.mark.parametrize("chunk", [1, 7, 128, 129, 4096])
def test_a_short_write_is_continued_never_published_short(tmp_path, monkeypatch, chunk):
    """A write may take fewer bytes than asked (a signal, a disk filling up): the writer
    goes on where it stopped, and the published file reads back whole and verified."""
    real_writev = os.writev
    calls = []

    def short_writev(fd, buffers):  # at most `chunk` bytes per call
        flat = b"".join(bytes(b) for b in buffers)[:chunk]
        calls.append(len(flat))
        return real_writev(fd, [flat])

    monkeypatch.setattr(os, "writev", short_writev)
    key = os.urandom(32)
    assert pf.write_block(tmp_path, NS, key, memoryview(payload(key, 3)), SHAPE, torch.float32)
    monkeypatch.undo()
    assert sum(calls) == pf.HEADER_SIZE + NBYTES and len(calls) > 1
    dest = bytearray(NBYTES)
    pf.read_block_into(tmp_path, NS, key, memoryview(dest), SHAPE, torch.float32)
    assert dest == payload(key, 3)


@pytest.mark.parametrize("nbytes", [0, 1, 240, 241, 1023, 1025, 1 << 14, (1 << 14) + 1,
                                    737_280 + 3])
def test_checksum_is_xxh3_64_whichever_entry_computes_it(nbytes):
    """The native entry Shoal picked (runtime-dispatched where the extension has it), the
    extension's baseline entry and the `xxhash` module agree on every size, unaligned
    starts included: files stay readable by any build."""
    import ctypes

    import xxhash
    import xxhash._xxhash as ext

    from shoal.connectors.store import block_format
    if block_format._XXH3 is None:
        pytest.skip("no native xxh3 entry in this xxhash build")
    baseline = ctypes.CDLL(ext.__file__).XXH3_64bits
    baseline.restype, baseline.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes + 1, dtype=np.uint8)
    for view in (payload[:nbytes], payload[1:]):  # aligned and unaligned starts
        expected = xxhash.xxh3_64_intdigest(view.tobytes())
        assert block_format._XXH3(view.ctypes.data, view.nbytes) == expected
        assert baseline(view.ctypes.data, view.nbytes) == expected
        assert pf.checksum(view) == expected
