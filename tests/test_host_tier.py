"""The host tier and the paged path of the fs worker (pages, copies, holds), on the CPU and,
when there is one, on a GPU: bytes in the KV cache compared with what was saved."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig, ConnectorContext, KVCacheRegistration
from shoal.connectors.fs import format as pf
from shoal.connectors.fs.connector import BlockTransfer, FsPoolMeta, FsPoolWorker
from shoal.connectors.store.host_tier import HostTier, tier_shape
from shoal.kv.kv_cache import KVCacheLayout
from tests.conftest import random_prompts

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


# -- the tier itself ---------------------------------------------------------------------

def test_pages_are_reused_least_recently_used_first_and_never_while_held():
    tier = HostTier(block_nbytes=8, num_pages=3, blocks_per_page=2, pinned=False)
    pages = []
    for key in (b"a", b"b", b"c"):
        page = tier.take_page()
        tier.publish(page, 0, key)
        tier.release(page)
        pages.append(page)
    assert sorted(pages) == [0, 1, 2]
    assert tier.find([b"a"]) == [(pages[0], 0)]  # held now, and the most recent on release
    tier.release(pages[0])
    assert tier.take_page() == pages[1]  # "b" was the least recently used
    assert tier.find([b"b", b"c", b"a"]) == [None, (pages[2], 0), (pages[0], 0)]
    assert tier.take_page(wait=False) is None  # every page held: c, a and the one taken
    assert tier.num_held_pages == 3
    for page in (pages[2], pages[0], pages[1]):
        tier.release(page)
    tier.check_integrity()
    assert tier.num_held_pages == 0 and tier.num_hits == 3


def test_take_page_waits_until_a_page_is_released():
    tier = HostTier(block_nbytes=8, num_pages=1, blocks_per_page=1, pinned=False)
    held = tier.take_page()
    got, started = [], threading.Event()

    def take():
        started.set()
        got.append(tier.take_page())
    t = threading.Thread(target=take)
    t.start()
    started.wait()
    t.join(timeout=0.3)
    assert t.is_alive() and not got  # still waiting: the only page is held
    tier.release(held)
    t.join(timeout=30)
    assert got == [held]


def test_tier_shape():
    assert tier_shape(0, 1 << 20) == (0, 16)  # no tier
    assert tier_shape(0, 1 << 20, min_pages=36) == (36, 16)  # staging only (a GPU)
    assert tier_shape(2 << 30, 1 << 20) == (128, 16)
    assert tier_shape(16 << 20, 1 << 20) == (8, 2)  # small: smaller pages, not fewer
    assert tier_shape(4 << 20, 1 << 20) == (4, 1)
    assert tier_shape(1 << 19, 1 << 20) == (0, 1)  # not one block: no tier


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fail_at", [0, 3, 5])
def test_a_load_that_raises_lets_go_of_every_page(device, fail_at):
    """A read that raises (a bug, a broken buffer) in any chunk of a load, with tier hits
    and chunks in flight around it: the load raises, and every page is let go."""
    from shoal.connectors.store.paged_io import PagedMover

    tier = HostTier(block_nbytes=64, num_pages=8, blocks_per_page=2, pinned=device == "cuda")
    mover = PagedMover(torch.zeros((16, 8), dtype=torch.int64, device=device), tier)
    keys = [bytes([i]) * 32 for i in range(7)]
    for first in (2, 4):  # blocks 2 and 4 are in the tier, each alone on a page
        page = tier.take_page()
        tier.publish(page, 0, keys[first])
        tier.release(page)

    def read(i: int, dest: memoryview) -> int | None:
        if i == fail_at:
            raise RuntimeError("broken buffer")
        return None  # a miss: nothing to check

    with pytest.raises(RuntimeError, match="broken buffer"):
        mover.load(keys, list(range(7)), read, corrupt=lambda i: None)
    assert tier.num_held_pages == 0
    tier.check_integrity()


class _NoStream:
    """Stands in for a CUDA stream and event where there is no GPU: work on CPU tensors
    is done when it is queued."""

    def __init__(self, blocking: bool = False): pass

    def wait_stream(self, other): pass

    def synchronize(self): pass

    def record(self, stream=None): pass


def test_the_gpu_branch_places_checks_and_publishes_by_the_book(monkeypatch):
    """The GPU branch of a load (staging, one index tensor, the check, the verdicts) run on
    CPU tensors with the streams stood in for and the check through Triton's interpreter:
    random chunks of tier hits, good reads, misses and reads whose checksum is wrong,
    several pages, and the wait for a page when all are held. Every bad read is reported
    once, never published and never placed; every good read is placed; the tier's entries
    hold their bytes; no page stays held."""
    import contextlib
    import random

    import xxhash

    from shoal.connectors.store import paged_io

    if torch.cuda.is_available():
        pytest.skip("runs the real branch on a GPU (tests/test_cuda.py)")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _NoStream)
    empty = torch.empty
    monkeypatch.setattr(paged_io.torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    nbytes = 256
    rng = random.Random(0)
    published = 0
    for trial in range(30):
        per, num_pages = rng.choice([(4, 3), (3, 4), (2, 6), (5, 2)])
        tier = HostTier(nbytes, num_pages, per, pinned=False)
        kv = torch.zeros((40, nbytes), dtype=torch.uint8)
        mover = paged_io.PagedMover(kv, tier)
        mover.is_cuda = mover.verifies = True
        staging = torch.empty((per, nbytes), dtype=torch.uint8).view(torch.int64)
        monkeypatch.setattr(mover, "_thread_buffers", lambda: (_NoStream(), staging))
        keys = [os.urandom(32) for _ in range(rng.randint(1, 14))]
        data = {k: os.urandom(nbytes) for k in keys}
        kind = {k: rng.choice(["good", "good", "missing", "corrupt", "tier"]) for k in keys}
        in_tier = [k for k in keys if kind[k] == "tier"][:per]
        kind.update({k: "good" for k in keys if kind[k] == "tier" and k not in in_tier})
        if in_tier:
            page = tier.take_page()
            for slot, k in enumerate(in_tier):
                tier.rows(page, slot, 1)[0].copy_(torch.frombuffer(bytearray(data[k]),
                                                                   dtype=torch.uint8))
                tier.publish(page, slot, k)
            tier.release(page)
        block_ids = rng.sample(range(40), len(keys))
        corrupt = []

        def read(i: int, dest: memoryview) -> int | None:
            if kind[keys[i]] == "missing":
                return None
            dest[:] = data[keys[i]]
            checksum = xxhash.xxh3_64_intdigest(data[keys[i]])
            return checksum ^ 1 if kind[keys[i]] == "corrupt" else checksum
        mover.load(keys, block_ids, read, corrupt.append)
        assert tier.num_held_pages == 0
        tier.check_integrity()
        assert sorted(corrupt) == [i for i, k in enumerate(keys) if kind[k] == "corrupt"]
        for i, k in enumerate(keys):
            where = tier.find([k])[0]
            if where is not None:  # (a good one may have been evicted by a later page)
                assert bytes(tier.rows(*where, 1)[0].numpy()) == data[k], (trial, i)
                tier.release(where[0])
            assert where is None or kind[k] in ("good", "tier"), (trial, i, kind[k])
            if kind[k] in ("missing", "corrupt"):  # never placed: the block keeps its bytes
                assert not kv[block_ids[i]].any(), (trial, i, kind[k])
            else:
                assert bytes(kv[block_ids[i]].numpy()) == data[k], (trial, i, kind[k])
        published += sum(tier.contains([k])[0] for k in keys if kind[k] == "good")
    assert published > 30  # good reads do become tier entries


# -- the worker's paged path --------------------------------------------------------------

LAYOUT = dict(num_layers=4, block_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32)


def make_worker(root, device, tier_bytes, num_blocks=64, threads=3):
    layout = KVCacheLayout(num_blocks, **LAYOUT)
    kv = torch.randn((num_blocks, *layout.block_shape), device=device)
    cfg = ConnectorConfig(name="fs", options={"root": str(root), "io_threads": threads,
                                              "host_tier_bytes": tier_bytes})
    worker = FsPoolWorker(cfg, ConnectorContext(0, 1, 0, 1, 0, 1, 4, "ab" * 32, device))
    worker.register_kv_caches(KVCacheRegistration(kv, layout))
    return worker, kv


def transfer(worker, meta: FsPoolMeta, rid: str, saving: bool, timeout: float = 60) -> None:
    """Run one step's transfers and poll until the request's are reported done."""
    worker.bind_connector_meta(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    worker.clear_connector_meta()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        saved, loaded = worker.get_finished([rid] if saving else [], [] if saving else [rid])
        if saved or loaded:
            return
    raise AssertionError(f"{rid}: not done within {timeout} s")


def saved_blocks(root, device, n):
    """A worker with a 64 MiB tier that saved its first `n` blocks under fresh keys:
    (worker, kv, keys, the blocks' bytes)."""
    worker, kv = make_worker(root, device, tier_bytes=64 << 20)
    keys = [os.urandom(32) for _ in range(n)]
    original = kv[:n].clone()
    transfer(worker, FsPoolMeta(saves=[BlockTransfer("s", i, i, k) for i, k in enumerate(keys)]),
             "s", saving=True)
    return worker, kv, keys, original


def flip_a_payload_bit(root, key: bytes, offset: int) -> None:
    path = next(p for p in pf.iter_block_files(root) if p.stem == key.hex())
    data = bytearray(path.read_bytes())
    data[pf.HEADER_SIZE + offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("device", DEVICES)
def test_saves_and_loads_through_the_tier_move_the_exact_bytes(tmp_path, device):
    n = 24
    worker, kv, keys, original = saved_blocks(tmp_path, device, n)
    assert worker.stats()["blocks_saved"] == n and len(list(pf.iter_block_files(tmp_path))) == n
    # loads into other blocks come from the tier: no file is read
    transfer(worker, FsPoolMeta(loads=[BlockTransfer("l", i, 32 + i, k) for i, k in enumerate(keys)]),
             "l", saving=False)
    assert torch.equal(kv[32:32 + n], original)
    stats = worker.stats()
    assert stats["host_tier_hit_blocks"] == n and stats["blocks_loaded"] == n
    worker.tier.check_integrity()
    assert worker.tier.num_held_pages == 0
    worker.shutdown()

    # a fresh worker (an empty tier) reads the files; a flipped byte fails that block only
    flip_a_payload_bit(tmp_path, keys[5], 77)
    fresh, kv2 = make_worker(tmp_path, device, tier_bytes=64 << 20)
    before = kv2[5].clone()
    transfer(fresh, FsPoolMeta(loads=[BlockTransfer("l", i, i, k) for i, k in enumerate(keys)]),
             "l", saving=False)
    assert fresh.get_failed_loads() == {"l": 5}
    good = [i for i in range(n) if i != 5]
    assert torch.equal(kv2[good], original[good])
    assert torch.equal(kv2[5], before)  # the corrupt block's bytes never reached the cache
    stats = fresh.stats()
    assert stats["corrupt_blocks"] == 1 and stats["host_tier_hit_blocks"] == 0
    fresh.shutdown()


def test_block_runs_join_consecutive_slots_going_to_consecutive_blocks():
    from shoal.connectors.store.paged_io import _runs

    # listed last block first, as loads are; slot 3 goes elsewhere; page 1 starts anew
    where = [(1, 0), (0, 3), (0, 2), (0, 1), (0, 0)]
    assert _runs(sorted(zip(where, [20, 9, 12, 11, 10]))) == [(0, 0, 10, 3), (0, 3, 9, 1),
                                                               (1, 0, 20, 1)]
    assert _runs(sorted(zip([(0, 1), (0, 0)], [5, 4]))) == [(0, 0, 4, 2)]
    assert _runs([]) == []
    # in staging order (targets 0, 1, ...): runs of consecutive slots as they come
    assert _runs(zip([(0, 2), (0, 3), (0, 0), (1, 1)], range(4))) == [
        (0, 2, 0, 2), (0, 0, 2, 1), (1, 1, 3, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_the_tier_holds_whole_goes_straight_into_its_blocks(tmp_path, device, monkeypatch):
    """Listed last block first, into two runs of consecutive blocks: the exact bytes land,
    nothing is staged or read, and no page stays held. Into scattered blocks (a run each)
    the load goes through the staging path instead: the same bytes."""
    from shoal.connectors.store import paged_io

    n = 24
    worker, kv, keys, original = saved_blocks(tmp_path, device, n)
    staged = []
    copy_in = paged_io.PagedMover._copy_in
    monkeypatch.setattr(paged_io.PagedMover, "_copy_in",
                        lambda self, *a: staged.append(1) or copy_in(self, *a))
    for targets, through_staging in (([*range(32, 44), *range(50, 62)], False),
                                     ([*range(62, 38, -1)], True)):  # 24 runs of one
        loads = [BlockTransfer("l", i, b, keys[i]) for i, b in zip(range(n), targets)][::-1]
        kv[32:].zero_()
        staged.clear()
        transfer(worker, FsPoolMeta(loads=loads), "l", saving=False)
        assert torch.equal(kv[targets], original)
        assert bool(staged) == through_staging and worker.get_failed_loads() == {}
        assert worker.tier.num_held_pages == 0
    stats = worker.stats()
    assert stats["host_tier_hit_blocks"] == 2 * n and stats["blocks_loaded"] == 2 * n
    worker.tier.check_integrity()
    worker.shutdown()


def _tier_with(keys: list[bytes], per_page: int) -> tuple[HostTier, dict[bytes, torch.Tensor]]:
    """A tier holding `keys` (random bytes each), `per_page` to a page, nothing held."""
    tier = HostTier(block_nbytes=64, num_pages=8, blocks_per_page=per_page, pinned=False)
    data = {}
    for first in range(0, len(keys), per_page):
        page = tier.take_page()
        for slot, key in enumerate(keys[first:first + per_page]):
            data[key] = torch.randint(0, 255, (64,), dtype=torch.uint8)
            tier.rows(page, slot, 1)[0].copy_(data[key])
            tier.publish(page, slot, key)
        tier.release(page)
    return tier, data


def test_a_page_emptied_after_the_straight_path_located_it_is_read_instead():
    """Between finding where the tier holds a load's blocks (no hold taken) and holding
    them, a page is emptied for another use: the load lets go of what it held and reads
    the blocks from the store: the exact bytes land, nothing stays held."""
    from shoal.connectors.store.block_format import checksum
    from shoal.connectors.store.paged_io import PagedMover

    keys = [bytes([i]) * 32 for i in range(4)]
    tier, data = _tier_with(keys, 2)
    kv = torch.zeros((16, 8), dtype=torch.int64)
    mover = PagedMover(kv, tier)
    find, lost = tier.find, []

    def find_after_a_page_went(wanted):
        if not lost:  # take pages (least recently used first) until one of the load's
            where = tier.locate(wanted)
            victim, taken = where[0][0], []
            lost.extend(k for k, w in zip(wanted, where) if w[0] == victim)
            while not taken or taken[-1] != victim:
                taken.append(tier.take_page())
            for page in taken:
                tier.release(page)
            for key in (k for k in wanted if k not in lost):  # the load's other pages are
                tier.release(find([key])[0][0])  # used last (no staging page evicts them)
        return find(wanted)
    tier.find = find_after_a_page_went
    reads = []

    def read(i: int, dest: memoryview) -> int:  # as the store's: the bytes, their checksum
        reads.append(i)
        dest[:] = data[keys[i]].numpy().tobytes()
        return checksum(dest)
    targets = [8, 9, 10, 11]  # two runs of two: the straight path takes it
    mover.load(keys, targets, read, corrupt=lambda i: None)
    assert lost and sorted(reads) == sorted(keys.index(k) for k in lost)
    for key, block in zip(keys, targets):
        assert torch.equal(kv[block].view(torch.uint8), data[key])
    assert tier.num_held_pages == 0
    tier.check_integrity()


def test_a_straight_copy_that_raises_lets_go_of_its_pages():
    from shoal.connectors.store.paged_io import PagedMover

    keys = [bytes([i]) * 32 for i in range(4)]
    tier, _ = _tier_with(keys, 2)
    mover = PagedMover(torch.zeros((16, 8), dtype=torch.int64), tier)
    mover.kv_rows = None  # the copy fails (a bug, a broken cache view)
    with pytest.raises(TypeError):
        mover.load(keys, [0, 1, 2, 3], read=None, corrupt=None)
    assert tier.num_held_pages == 0
    tier.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_part_in_the_tier_part_in_files(tmp_path, device):
    """The blocks the tier holds move in one task, the others are read by every I/O
    thread; the first failed block is reported whichever task read it."""
    n = 24
    worker, _, keys, original = saved_blocks(tmp_path, device, n)
    worker.shutdown()
    fresh, kv2 = make_worker(tmp_path, device, tier_bytes=64 << 20)
    held = [*range(8), *range(16, n)]  # loaded once: now in the tier; 8-15 are not
    transfer(fresh, FsPoolMeta(loads=[BlockTransfer("h", i, i, keys[i]) for i in held]),
             "h", saving=False)
    flip_a_payload_bit(tmp_path, keys[12], 5)
    loads = [BlockTransfer("l", i, 32 + i, k) for i, k in enumerate(keys)]
    tasks = fresh._load_units(loads)
    assert [t.block_index for t in tasks[0]] == held
    assert sorted(t.block_index for task in tasks[1:] for t in task) == list(range(8, 16))
    kv2[32:].zero_()
    transfer(fresh, FsPoolMeta(loads=loads), "l", saving=False)
    assert fresh.get_failed_loads() == {"l": 12}
    good = [i for i in range(n) if i != 12]
    assert torch.equal(kv2[[32 + i for i in good]], original[good])
    assert not kv2[32 + 12].any()  # the corrupt block's bytes never reached the cache
    stats = fresh.stats()
    assert stats["host_tier_hit_blocks"] == len(held) and stats["corrupt_blocks"] == 1
    assert fresh.tier.num_held_pages == 0
    fresh.tier.check_integrity()
    fresh.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_a_tier_smaller_than_the_transfer_still_moves_every_block(tmp_path, device):
    n = 48
    # a tier of 8 blocks (on a GPU the staging minimum adds pages: still far below 48)
    block_nbytes = KVCacheLayout(1, **LAYOUT).block_nbytes
    worker, kv = make_worker(tmp_path, device, tier_bytes=8 * block_nbytes, num_blocks=2 * n)
    keys = [os.urandom(32) for _ in range(n)]
    original = kv[:n].clone()
    transfer(worker, FsPoolMeta(saves=[BlockTransfer("s", i, i, k) for i, k in enumerate(keys)]),
             "s", saving=True)
    transfer(worker, FsPoolMeta(loads=[BlockTransfer("l", i, n + i, k) for i, k in enumerate(keys)]),
             "l", saving=False)
    assert torch.equal(kv[n:], original)
    assert worker.stats()["host_tier_hit_blocks"] < n  # some came from files
    assert worker.tier.num_held_pages == 0
    worker.tier.check_integrity()
    worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_an_idle_wait_for_transfers_ends_when_they_move(tmp_path, device):
    """An engine that only waits for transfers waits in wait_for_transfers between polls:
    it wakes when a save ends or a load's unit lands, not at its timeout (a missed wake
    would take the whole 30 s)."""
    worker, kv = make_worker(tmp_path, device, tier_bytes=1 << 20)
    keys = [os.urandom(32) for _ in range(24)]
    original = kv[:24].clone()
    start = time.monotonic()
    for rid, meta in (("s", FsPoolMeta(saves=[BlockTransfer("s", i, i, k)
                                              for i, k in enumerate(keys)])),
                      ("l", FsPoolMeta(loads=[BlockTransfer("l", i, 32 + i, k)
                                              for i, k in enumerate(keys)]))):
        worker.bind_connector_meta(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        worker.clear_connector_meta()
        waits = 0
        while not any(worker.get_finished([rid] if rid == "s" else [],
                                          [rid] if rid == "l" else [])):
            worker.wait_for_transfers(30)
            waits += 1
            assert waits <= len(keys) + 8, rid  # each wait ends with something that moved
    assert time.monotonic() - start < 15
    assert torch.equal(kv[32:56], original)
    worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_copies_of_blocks_read_from_files_wait_while_a_forward_is_launched(tmp_path, device,
                                                                           monkeypatch):
    """From start_load_kv to wait_for_save the executing thread launches the step's
    forward: on a GPU a chunk read from files holds its copies and checks back meanwhile
    (their torch calls would take the GIL from the launch), and the load lands once the
    launch is done. On a CPU nothing waits: the gate only opens and closes."""
    from shoal.connectors.store import paged_io

    n = 12
    saver, _, keys, original = saved_blocks(tmp_path, device, n)
    saver.shutdown()
    monkeypatch.setattr(paged_io, "LAUNCH_WAIT_S", 60.0)  # a missed open would hang the test
    worker, kv = make_worker(tmp_path, device, tier_bytes=64 << 20)
    gate = worker._mover._not_launching
    held = threading.Event()  # an I/O thread waits at the gate
    real_wait = gate.wait

    def wait(timeout=None):
        if not gate.is_set():
            held.set()
        return real_wait(timeout)
    monkeypatch.setattr(gate, "wait", wait)
    worker.bind_connector_meta(FsPoolMeta(loads=[BlockTransfer("l", i, 32 + i, k)
                                                 for i, k in enumerate(keys)]))
    worker.start_load_kv()
    assert not gate.is_set()
    if device == "cuda":
        assert held.wait(30)
        assert worker.get_finished([], ["l"]) == (set(), set())  # held at the gate
    worker.wait_for_save()  # the launch is done
    assert gate.is_set()
    worker.clear_connector_meta()
    deadline = time.monotonic() + 60
    while not worker.get_finished([], ["l"])[1]:
        assert time.monotonic() < deadline
        worker.wait_for_transfers(1)
    assert torch.equal(kv[32:32 + n], original)
    assert held.is_set() == (device == "cuda")
    worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_abort_returns_only_after_the_copies_of_running_loads_end(tmp_path, device):
    n = 48
    worker, kv = make_worker(tmp_path, device, tier_bytes=0 if device == "cuda" else 1 << 20,
                             num_blocks=2 * n, threads=2)
    keys = [os.urandom(32) for _ in range(n)]
    transfer(worker, FsPoolMeta(saves=[BlockTransfer("s", i, i, k) for i, k in enumerate(keys)]),
             "s", saving=True)
    worker.shutdown()
    fresh, kv2 = make_worker(tmp_path, device, tier_bytes=0 if device == "cuda" else 1 << 20,
                             num_blocks=2 * n, threads=2)
    fresh.bind_connector_meta(FsPoolMeta(loads=[BlockTransfer("l", i, i, k)
                                                for i, k in enumerate(keys)]))
    fresh.start_load_kv()
    fresh.clear_connector_meta()
    fresh.abort(["l"])  # at once: tasks not started are dropped, running ones waited for
    assert fresh.tier.num_held_pages == 0  # no copy still holds a page
    fresh.tier.check_integrity()
    assert fresh.get_finished([], ["l"]) == (set(), set())  # forgotten
    fresh.shutdown()


# -- the engine with a tier on the CPU ----------------------------------------------------

KW = dict(block_size=4, num_kv_blocks=128, enable_prefix_caching=False)
SP = SamplingParams(max_tokens=8)


@pytest.mark.parametrize("tier_blocks", [64, 6])  # roomy; fewer blocks than one request's
def test_engine_repeat_hits_come_from_the_tier(tiny_model, tmp_path, tier_blocks):
    prompts = random_prompts(512, [41, 37], seed=3)
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
        block_nbytes = llm.engine.kv_cache.layout.block_nbytes
    # whole loads: every matched block is loaded (a split depends on measured rates)
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path),
                                              "host_tier_bytes": tier_blocks * block_nbytes},
                          compute_while_loading=False)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        first = [o.token_ids for o in llm.generate(prompts, SP)]  # computed, saved via pages
        again = llm.generate(prompts, SP)  # no local prefix cache: from the pool
        llm.check_integrity()
        stats = llm.stats()
    assert first == expected and [o.token_ids for o in again] == expected
    assert [o.num_connector_tokens for o in again] == [40, 36]
    assert stats["blocks_loaded"] == 19
    # the scheduler side expects what the tier holds: the blocks it sent (saves, loads),
    # as many as fit
    host = [o.pool_hit.num_host_tokens for o in again]
    if tier_blocks == 64:
        assert stats["host_tier_hit_blocks"] == 19  # every block loaded came from memory
        assert host == [40, 36] and stats["pool_hit_host_tokens"] == 76
    else:  # at most 6 from memory, the rest read from their files
        assert stats["host_tier_hit_blocks"] <= 6
        assert all(n <= 6 * 4 for n in host)


def pin_load_rates(llm: LLM, prefill: float, store: float, host: float) -> None:
    """The planner decides from these rates and measures nothing."""
    p = llm.engine.transfers.planner
    p.prefill_tps.value, p.load_tps.value, p.host_load_tps.value = prefill, store, host
    p.load_latency_s.value = p.host_load_latency_s.value = 0.0
    p.prefill_overhead_s = 0.0
    p.observe_prefill = p.observe_load = p.observe_front = lambda *a, **k: None
    p.front_slowdown.value = p.load_slowdown.value = None  # (as a rates file may restore)


def test_a_hit_in_host_memory_is_loaded_where_one_from_files_is_computed(tiny_model, tmp_path):
    """Store reads slower than computing, host memory far faster: the same prompt's hit is
    computed by a fresh engine (its tier is empty) and loaded by one that saved it."""
    prompt = random_prompts(512, [41], seed=4)
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompt, SP)]
        tier_bytes = 64 * llm.engine.kv_cache.layout.block_nbytes
    cfg = ConnectorConfig(name="fs", options={"root": str(tmp_path), "host_tier_bytes": tier_bytes})
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        pin_load_rates(llm, prefill=400.0, store=4.0, host=1e7)
        assert [o.token_ids for o in llm.generate(prompt, SP)] == expected  # saved
        again = llm.generate(prompt, SP)[0]
        llm.check_integrity()
    assert again.token_ids == expected[0]
    assert again.pool_hit.decision == "load" and again.pool_hit.num_host_tokens == 40
    assert again.num_connector_tokens == 40
    assert again.pool_hit.load_tokens_per_s == 1e7  # the rate the decision weighed
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:  # a new process: an empty tier
        pin_load_rates(llm, prefill=400.0, store=4.0, host=1e7)
        fresh = llm.generate(prompt, SP)[0]
        llm.check_integrity()
    assert fresh.token_ids == expected[0]
    assert fresh.pool_hit.decision == "compute" and fresh.pool_hit.num_host_tokens == 0
    assert fresh.num_connector_tokens == 0
