"""The fs pool's read processes (fs/read_procs.py): block files read by processes of their
own into a shared host tier give the same tokens as no pool and as the I/O threads' reads,
keep every check of the in-process read, and survive a read process that dies."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.connectors.fs.connector import open_pool
from shoal.kv.block_keys import extend_block_keys, request_seed
from tests.conftest import random_prompts

SP = SamplingParams(max_tokens=8)
KW = dict(block_size=4, num_kv_blocks=128)
TIER = 1 << 20  # a host tier on the CPU: blocks move through its pages, as on a GPU


@pytest.fixture(scope="module")
def workload():
    shared = random_prompts(512, [40], seed=11)[0]  # 10 blocks of 4
    return [shared + t for t in random_prompts(512, [3, 5], seed=12)]


@pytest.fixture(scope="module")
def baseline(tiny_model, workload):
    with LLM(tiny_model, **KW) as llm:
        return [o.token_ids for o in llm.generate(workload, SP)]


def pool_with(root, procs: int, **options) -> ConnectorConfig:
    return ConnectorConfig(name="fs", compute_while_loading=False, options={
        "root": str(root), "host_tier_bytes": TIER, "read_processes": procs, **options})


def readers(llm):
    return llm.engine.transfers.calls.worker.store._readers


def wait_ready(llm) -> None:
    """Until every read process has said it is ready (a load meanwhile reads on its thread)."""
    assert readers(llm).wait_ready(60), "read processes did not start"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_loads_read_by_processes_match_no_pool_and_the_processes_end(tiny_model, workload,
                                                                      baseline, tmp_path, device):
    """On a GPU the shared tier is pinned by registering it (cudaHostRegister); the blocks
    read into it are verified there."""
    kw = dict(KW, device=device)
    if device != "cpu":
        with LLM(tiny_model, **kw) as llm:
            baseline = [o.token_ids for o in llm.generate(workload, SP)]
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2), **kw) as llm:
        assert [o.token_ids for o in llm.generate(workload, SP)] == baseline
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2), **kw) as llm:
        wait_ready(llm)
        pids = readers(llm).pids
        assert len(pids) == 2
        outs = llm.generate(workload, SP)
        llm.check_integrity()
        assert [o.token_ids for o in outs] == baseline
        # the shared prefix is loaded once (the other request finds it in the cache and
        # loads its own 11th block)
        assert sorted(o.num_connector_tokens for o in outs) == [4, 40]
        assert readers(llm).num_blocks_read == llm.stats()["blocks_loaded"] == 11
    assert not any(alive(pid) for pid in pids)  # ended (and reaped) at shutdown


def test_a_corrupt_file_read_by_a_process_is_quarantined_and_recomputed(tiny_model, workload,
                                                                        baseline, tmp_path):
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 1), **KW) as llm:
        llm.generate(workload[:1], SP)
        keys: list[bytes] = []
        extend_block_keys(keys, workload[0], 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
    path = pf.block_path(tmp_path, keys[6])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a flipped payload byte: only the checksum finds it
    path.write_bytes(bytes(data))
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 1), **KW) as llm:
        wait_ready(llm)
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        s = llm.stats()
        readers_read = readers(llm).num_blocks_read
    assert out.token_ids == baseline[0]
    assert out.num_connector_tokens == 24  # blocks 0-5; recomputed from block 6 on
    assert readers_read == 9  # the process read all ten, and found block 6 corrupt
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    assert [p.name.startswith(keys[6].hex()) for p in (tmp_path / "quarantine").iterdir()] == [True]


def test_a_read_process_that_dies_leaves_its_reads_to_the_threads(tiny_model, workload,
                                                                    baseline, tmp_path, caplog):
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 1), **KW) as llm:
        llm.generate(workload[:1], SP)
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 1), **KW) as llm:
        wait_ready(llm)
        (pid,) = readers(llm).pids
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # dead (and reaped here: the pool's own wait then finds no child)
        out = llm.generate(workload[:1], SP)[0]  # the chunk it was sent: read by the thread
        llm.check_integrity()
        assert out.token_ids == baseline[0] and out.num_connector_tokens == 40
        assert llm.stats()["missing_blocks"] == 0 and readers(llm).num_blocks_read == 0
        assert readers(llm).num_alive == 0
    assert "the I/O threads read the files from now on" in caplog.text


def test_read_processes_that_cannot_start_leave_the_reads_to_the_threads(
        tiny_model, workload, baseline, tmp_path, monkeypatch, caplog):
    from shoal.connectors.fs import read_procs

    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2), **KW) as llm:
        llm.generate(workload[:1], SP)
    monkeypatch.setattr(read_procs, "_BOOT", "import sys; sys.exit(3)")
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2), **KW) as llm:
        procs = list(readers(llm)._procs.values())
        for proc in procs:
            proc.wait()  # (exited; their pipes say so at the first read)
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        assert out.token_ids == baseline[0] and out.num_connector_tokens == 40
        assert readers(llm).num_alive == 0 and readers(llm).num_blocks_read == 0
    assert [p.returncode for p in procs] == [3, 3]
    assert "the I/O threads read the files from now on" in caplog.text


def test_a_read_process_imports_no_torch_and_runs_behind_the_engine(tiny_model, tmp_path):
    """It maps no torch library (its start and memory stay small), and its nice value is
    NICENESS above the engine's (a forward's launch goes first on busy CPUs)."""
    from shoal.connectors.fs.read_procs import NICENESS
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 1), **KW) as llm:
        wait_ready(llm)
        (pid,) = readers(llm).pids
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(ours + NICENESS, 19)
        libraries = {line.split()[-1] for line in open(f"/proc/{pid}/maps") if "/" in line}
    assert any("xxhash" in path for path in libraries)
    # (an install may live under a folder named torch: the library names tell, not the path)
    assert not [p for p in libraries if os.path.basename(p).startswith(("libtorch", "libc10"))
                or "/torch/lib/" in p or "/torch/_C" in p], libraries


def test_read_processes_are_checked_and_not_started_under_a_read_cap(tiny_model, tmp_path):
    for bad in (-1, 65, "2", True, 1.5):
        with pytest.raises(ValueError, match="read_processes"):
            LLM(tiny_model, kv_connector=pool_with(tmp_path, bad), **KW)
    default = ConnectorConfig(name="fs", options={"root": str(tmp_path)})
    assert open_pool(default).read_processes == 0  # (on a GPU: test_fs_pool's defaults)
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2, max_read_gbps=10.0), **KW) as llm:
        assert readers(llm) is None  # the cap paces the threads' reads
    with LLM(tiny_model, kv_connector=ConnectorConfig(name="fs", options={
            "root": str(tmp_path), "read_processes": 2}), **KW) as llm:
        assert readers(llm) is None  # no tier on a CPU: blocks are read into the cache


def rchar(pid: int) -> int:
    """Bytes the process has read through system calls (its files and its pipe)."""
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar for {pid}")


def test_a_chunk_is_split_among_the_idle_processes(tiny_model, workload, baseline, tmp_path):
    """Ten blocks, three processes idle, one I/O thread: shares of at least four blocks
    (MIN_SHARE), so two of them read, five blocks each; the third stays idle."""
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 3), **KW) as llm:
        llm.generate(workload[:1], SP)
    block_file = next(p for p in (tmp_path / "blocks").rglob("*") if p.is_file())
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 3, io_threads=1), **KW) as llm:
        wait_ready(llm)
        pids = readers(llm).pids
        before = {pid: rchar(pid) for pid in pids}
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        grew = sorted(rchar(pid) - before[pid] for pid in pids)
        assert out.token_ids == baseline[0] and out.num_connector_tokens == 40
        assert readers(llm).num_blocks_read == 10 and readers(llm).num_alive == 3
        assert len(readers(llm)._idle) == 3  # every process handed back
    assert grew[0] == 0 and grew[1] >= 5 * block_file.stat().st_size


def test_a_process_that_dies_mid_split_leaves_the_chunk_to_the_thread(tiny_model, workload,
                                                                      baseline, tmp_path):
    """The chunk's first share goes to a living process, the second to one that died: the
    living one's share is still waited for (nothing writes the rows once `read` returns),
    then the thread reads the whole chunk; the living process is handed back."""
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2), **KW) as llm:
        llm.generate(workload[:1], SP)
    block_file = next(p for p in (tmp_path / "blocks").rglob("*") if p.is_file())
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2, io_threads=1), **KW) as llm:
        wait_ready(llm)
        r = readers(llm)
        # the last idle process is taken first, the others after it (in order)
        dead, living = (r._procs[c].pid for c in r._idle)
        os.kill(dead, signal.SIGKILL)
        os.waitpid(dead, 0)
        before = rchar(living)
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        assert out.token_ids == baseline[0] and out.num_connector_tokens == 40
        assert llm.stats()["missing_blocks"] == 0
        assert r.pids == [living] and r.num_blocks_read == 0 and len(r._idle) == 1
        assert rchar(living) - before >= 5 * block_file.stat().st_size


@pytest.fixture
def thirteen_blocks(tmp_path):
    """Three read processes over a pool of 13 blocks (block i's floats all equal i), and
    their 16-row slab."""
    import mmap

    from shoal.connectors.fs.connector import FsStore
    from shoal.connectors.fs.read_procs import ReadProcesses
    from shoal.connectors.store.base import BlockSpec

    spec = BlockSpec(bytes(32), (2, 64), torch.float32, 512)
    store = FsStore(tmp_path)
    keys = [os.urandom(32) for _ in range(13)]
    for i, key in enumerate(keys):
        assert store.write(key, memoryview(torch.full((2, 64), float(i)).numpy()).cast("B"),
                           spec)
    nbytes = 16 * spec.nbytes
    fd = os.memfd_create("slab")
    os.ftruncate(fd, nbytes)
    slab = mmap.mmap(fd, nbytes)
    readers = ReadProcesses(tmp_path, spec, fd, nbytes, 3, None)
    try:
        assert readers.wait_ready(60) and len(readers._idle) == 3
        yield readers, keys, torch.frombuffer(slab, dtype=torch.float32).view(16, 2, 64)
    finally:
        readers.close()
        os.close(fd)


def test_a_chunk_splits_evenly_in_order_and_an_empty_read_takes_no_process(thirteen_blocks):
    """13 blocks over three processes (shares of 5, 4, 4) land in their rows in order; an
    empty read answers at once."""
    readers, keys, rows = thirteen_blocks
    assert readers.read([], 0, True) == [] and len(readers._idle) == 3
    sums = readers.read(keys, 2, True)
    assert all(isinstance(c, int) for c in sums) and len(sums) == 13
    assert [int(rows[2 + i, 0, 0]) for i in range(13)] == list(range(13))
    assert readers.num_blocks_read == 13 and len(readers._idle) == 3


@pytest.mark.parametrize("num_readers, num_reading", [(2, 2), (3, 1)])
def test_a_thread_takes_its_part_of_the_processes(thirteen_blocks, num_readers, num_reading):
    """Three processes for `num_readers` I/O threads: a thread's chunk is split among its
    part, rounded up (2 of 3 for 2 threads, 1 for 3); every process is handed back."""
    readers, keys, rows = thirteen_blocks
    readers.readers = num_readers
    pids = readers.pids
    before = {pid: rchar(pid) for pid in pids}
    assert all(isinstance(c, int) for c in readers.read(keys, 1, True))
    assert [int(rows[1 + i, 0, 0]) for i in range(13)] == list(range(13))
    grew = [rchar(pid) - before[pid] for pid in pids]
    assert sum(g > 0 for g in grew) == num_reading and len(readers._idle) == 3


def test_threads_reading_at_once_while_a_process_dies_end_with_every_process_idle(
        thirteen_blocks):
    """Four threads read at once, 20 chunks each, while one of the three processes is
    killed: no read hangs, each answers its chunk whole (or None: the thread reads it),
    the rows hold the blocks, and the two processes left are idle at the end."""
    import threading

    readers, keys, rows = thirteen_blocks
    readers.readers = 4
    results, errors = [], []
    started = threading.Barrier(5)

    def reads():
        started.wait()
        try:
            for _ in range(20):
                results.append(readers.read(keys, 0, True))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=reads) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    victim = readers.pids[0]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors
    assert len(results) == 80 and any(r is not None for r in results)
    assert all(r is None or (len(r) == 13 and all(isinstance(c, int) for c in r))
               for r in results)
    assert [int(rows[i, 0, 0]) for i in range(13)] == list(range(13))
    readers.readers = 1  # a read takes every process: it meets the dead one if none has
    readers.read(keys, 0, True)
    assert readers.read(keys, 0, True) is not None
    assert readers.num_alive == 2 and len(readers._idle) == 2


@pytest.mark.parametrize("load_mode, num_readers", [("async", 3), ("sync", 1)])
def test_the_processes_are_shared_by_the_threads_that_read(tiny_model, tmp_path, load_mode,
                                                           num_readers):
    """Async loads: the I/O threads share the processes; sync loads: the one thread that
    loads (inside start_load_kv) has them all."""
    with LLM(tiny_model, kv_connector=pool_with(tmp_path, 2, io_threads=3, load_mode=load_mode),
             **KW) as llm:
        assert readers(llm).readers == num_readers


def test_a_process_that_becomes_idle_takes_a_share_left(thirteen_blocks, monkeypatch):
    """A thread that starts with one process (the other two busy elsewhere) gives a share
    it has not sent to a process that became idle meanwhile."""
    from shoal.connectors.fs import read_procs

    readers, keys, rows = thirteen_blocks
    busy = readers._take_idle(2)  # (another thread's, for now)
    busy_pids = [readers._procs[c].pid for c in busy]
    before = {pid: rchar(pid) for pid in busy_pids}
    real_wait = read_procs.wait

    def wait_once_freed(conns, timeout=None):  # the first wait: the other thread is done
        if busy:
            with readers._cond:
                readers._idle.extend(busy)
                busy.clear()
        return real_wait(conns, timeout)
    monkeypatch.setattr(read_procs, "wait", wait_once_freed)
    assert all(isinstance(c, int) for c in readers.read(keys, 0, True))
    assert [int(rows[i, 0, 0]) for i in range(13)] == list(range(13))
    assert max(rchar(pid) - before[pid] for pid in busy_pids) > 0 and len(readers._idle) == 3


def test_an_error_raised_mid_send_ends_the_processes_it_may_have_left_writing(thirteen_blocks, monkeypatch):
    """A send that raises something else than a broken pipe (here a ValueError) is
    re-raised. Its process, whose pipe may hold half a message, is ended, and so is the one
    already sent its share (it may still write its rows, and nothing waits for an answer
    once an error is raised); the one not sent to yet is handed back, and the next read
    works with it alone."""
    from multiprocessing.connection import Connection

    readers, keys, rows = thirteen_blocks
    victim = readers._idle[0]  # taken second (the last idle one is taken first)
    send = Connection.send

    def failing_send(conn, obj):
        if conn is victim:
            raise ValueError("cannot pickle")
        return send(conn, obj)
    monkeypatch.setattr(Connection, "send", failing_send)
    with pytest.raises(ValueError, match="cannot pickle"):
        readers.read(keys, 0, True)
    monkeypatch.setattr(Connection, "send", send)
    assert readers.num_alive == 1 and len(readers._idle) == 1 and victim not in readers._idle
    assert readers.read(keys, 3, True) is not None
    assert [int(rows[3 + i, 0, 0]) for i in range(13)] == list(range(13))
