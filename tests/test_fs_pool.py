"""The filesystem pool connector: persistence, local + pool reuse, corruption, failures."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.kv.block_keys import extend_block_keys, request_seed
from shoal.connectors import ConnectorConfig
from shoal.connectors.fs import format as pf
from shoal.connectors.fs.connector import FsStore
from tests.conftest import count_lookups, random_prompts

SP = SamplingParams(max_tokens=10)
KW = dict(block_size=4, num_kv_blocks=128)


@pytest.fixture(scope="module")
def workload():
    shared = random_prompts(512, [40], seed=7)[0]  # 10 full blocks of 4
    return [shared + t for t in random_prompts(512, [3, 6, 1], seed=8)]


@pytest.fixture(scope="module")
def baseline(tiny_model, workload):
    with LLM(tiny_model, **KW) as llm:
        return [o.token_ids for o in llm.generate(workload, SP)]


def whole_loads(pool, **options) -> ConnectorConfig:
    """The fs pool with every hit loaded whole: these tests count and order what is loaded
    (how a hit is split between loading and computing depends on measured rates:
    tests/test_compute_while_loading.py)."""
    return ConnectorConfig(name="fs", options={"root": str(pool), **options},
                           compute_while_loading=False)


def produce(model, pool, prompts, **kw):
    with LLM(model, kv_pool=str(pool), **{**KW, **kw}) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        return outs, llm.stats()


def block_files(pool: Path) -> list[Path]:
    return list(pf.iter_block_files(pool))


RUN_IN_PROCESS = """
import json, sys
from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
model, pool, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = ConnectorConfig(name="fs", options={"root": pool}, compute_while_loading=False)
with LLM(model, kv_connector=cfg, block_size=4, num_kv_blocks=128) as llm:
    outs = llm.generate(prompts, SamplingParams(max_tokens=10))
    llm.check_integrity()
    print(json.dumps({"tokens": [o.token_ids for o in outs],
                      "loaded": [o.num_connector_tokens for o in outs], "stats": llm.stats()}))
"""


def run_process(model, pool, prompts) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN_IN_PROCESS, model, str(pool), json.dumps(prompts)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_restart_persistence_across_processes(tiny_model, workload, baseline, tmp_path):
    pool = tmp_path / "pool"
    producer = run_process(tiny_model, pool, workload)
    assert producer["tokens"] == baseline
    assert producer["stats"]["blocks_saved"] == 11 and producer["stats"]["pool_hit_blocks"] == 0
    consumer = run_process(tiny_model, pool, workload)
    assert consumer["tokens"] == baseline
    # the first request loads the shared 40 tokens; the two arriving with it wait for that
    # load and hit it locally (the second loads its one block past it)
    assert consumer["loaded"] == [40, 4, 0]
    s = consumer["stats"]
    assert s["pool_hit_blocks"] == 11 and s["pool_miss_blocks"] == 0
    assert s["connector_tokens_loaded"] == 44 and s["bytes_loaded"] > 0
    assert s["local_prefix_hit_tokens"] == 80
    assert s["blocks_saved"] == 0  # nothing new to save


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("load_mode", ["async", "sync"])
def test_local_prefix_and_pool_together(tiny_model, tmp_path, overlap, load_mode):
    x, y, tail, other = random_prompts(512, [16, 24, 5, 7], seed=11)
    full, partial = x + y + tail, x + other
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate([partial, full], SP)]
    pool = tmp_path / "pool"
    produce(tiny_model, pool, [full])
    cfg = whole_loads(pool, load_mode=load_mode)
    with LLM(tiny_model, kv_connector=cfg, overlap_scheduler=overlap, **KW) as llm:
        first = llm.generate([partial], SP)[0]  # loads x from the pool, caches it locally
        second = llm.generate([full], SP)[0]  # x local, y from the pool, tail computed
        llm.check_integrity()
    assert [first.token_ids, second.token_ids] == expected
    assert (first.num_local_prefix_tokens, first.num_connector_tokens) == (0, 16)
    # 45 tokens: blocks 4..10 come from the pool (y and the first full block of the tail)
    assert (second.num_local_prefix_tokens, second.num_connector_tokens) == (16, 28)


@pytest.mark.parametrize("split", [False, True])
def test_requests_arriving_together_load_a_shared_prefix_once(tiny_model, workload, tmp_path,
                                                               split):
    """Four requests on one pooled prefix arrive in one step: the first one's hit brings the
    prefix in (loaded whole, or computed from the front while the back loads); the others
    wait for it and hit it locally. None loads it again."""
    prompts = [workload[0][:40] + t for t in random_prompts(512, [5, 7, 2, 9], seed=21)]
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])  # the shared 40 tokens: 10 blocks
    cfg = ConnectorConfig(name="fs", options={"root": str(pool)}, compute_while_loading=split)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        s = llm.stats()
    assert [o.token_ids for o in outs] == expected
    hit = outs[0].pool_hit
    assert hit is not None and hit.num_matched_tokens == 40
    assert hit.num_front_tokens + hit.num_loaded_tokens == 40
    assert [(o.num_local_prefix_tokens, o.pool_hit) for o in outs[1:]] == [(40, None)] * 3
    assert s["pool_hit_blocks"] == 10 and s["connector_tokens_loaded"] == hit.num_loaded_tokens


def test_a_burst_larger_than_the_batch_waits_in_order_for_one_load(tiny_model, workload,
                                                                   tmp_path):
    """Six requests on one pooled prefix, room for two in the batch: the first loads the
    prefix, the others wait for it (at most two passed over in a step) and are admitted in
    the order they came, each hitting it locally."""
    prompts = [workload[0][:40] + t for t in random_prompts(512, [5, 7, 2, 9, 3, 6], seed=23)]
    kw = dict(KW, max_batch_size=2)
    with LLM(tiny_model, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])
    with LLM(tiny_model, kv_connector=whole_loads(pool), **kw) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        s = llm.stats()
    assert [o.token_ids for o in outs] == expected
    assert outs[0].num_connector_tokens == 40 and s["connector_tokens_loaded"] == 40
    assert [(o.num_local_prefix_tokens, o.num_connector_tokens) for o in outs[1:]] == [(40, 0)] * 5
    admitted = [o.metrics.scheduled_time for o in outs]
    assert admitted == sorted(admitted)


def test_a_request_does_not_wait_for_its_last_token_s_block(tiny_model, workload, tmp_path,
                                                            monkeypatch):
    """B is the shared 40 tokens, 10 whole blocks: no hit covers its last token's block (9),
    so it does not wait for A's load of block 9: it computes it itself."""
    from shoal.engine.transfers import KVTransfers

    shared = workload[0][:40]
    pool = tmp_path / "pool"
    produce(tiny_model, pool, [workload[0]])  # the shared prefix: blocks 0-9
    asked = []
    brings_in = KVTransfers.brings_in

    def spy(self, req, num_cached):
        answer = brings_in(self, req, num_cached)
        asked.append((req.num_tokens, num_cached, answer))
        return answer

    monkeypatch.setattr(KVTransfers, "brings_in", spy)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        llm.generate([shared[:36] + [1]], SP)  # blocks 0-8 cached locally
        a, b = llm.generate([workload[0], shared], SP)
        llm.check_integrity()
    assert a.num_local_prefix_tokens == 36 and a.num_connector_tokens == 4
    assert (b.num_local_prefix_tokens, b.num_connector_tokens) == (36, 0)
    assert (40, 36, False) in asked and (40, 36, True) not in asked


def _corrupt(path: Path, kind: str, tiny_pool: Path) -> None:
    data = path.read_bytes()
    if kind == "flipped_byte":
        i = pf.HEADER_SIZE + 100
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:])
    elif kind == "truncated":
        path.write_bytes(data[:-7])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "wrong_namespace":
        header = pf.parse_header(data[:pf.HEADER_SIZE])
        payload = data[pf.HEADER_SIZE:]
        path.write_bytes(pf.encode_header(b"\x01" * 32, header.key, header.shape, torch.float32,
                                          len(payload), pf.checksum(payload)) + payload)
    elif kind == "header_flip":
        path.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])


@pytest.mark.parametrize("kind", ["flipped_byte", "truncated", "empty", "garbage",
                                  "wrong_namespace", "header_flip"])
def test_corrupt_file_is_a_miss_recomputed_and_quarantined(tiny_model, workload, baseline,
                                                           tmp_path, kind):
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])
    with LLM(tiny_model, kv_pool=str(pool), **KW) as probe:
        keys: list[bytes] = []
        extend_block_keys(keys, workload[0], 4,
                          request_seed(bytes.fromhex(probe.engine.info.namespace), None))
    bad_key = keys[2]
    bad_path = pf.block_path(pool, bad_key)
    assert bad_path.is_file()
    _corrupt(bad_path, kind, pool)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        s = llm.stats()
    assert out.token_ids == baseline[0]
    assert out.num_connector_tokens == 8  # blocks 0 and 1; recomputed from block 2 on
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    quarantined = list((pool / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(bad_key.hex())
    assert pf.block_path(pool, bad_key).is_file()  # the recomputed block was saved again


def test_blocks_a_load_brought_are_looked_up_once(tiny_model, workload, baseline, tmp_path,
                                                  monkeypatch):
    """Admission finds the request's blocks in the pool; deciding what to save later does not
    look them up again (a lookup is a file system call: 512 of them for an 8k prompt)."""
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])
    looked = count_lookups(monkeypatch)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        out = llm.generate(workload[:1], SP)[0]
        llm.check_integrity()
        keys: list[bytes] = []
        extend_block_keys(keys, workload[0], 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
    assert out.token_ids == baseline[0] and out.num_connector_tokens == 40
    assert [looked.get(pf.block_path_str(str(pool), k)) for k in keys[:10]] == [1] * 10


def _scheduler_clock(monkeypatch) -> list[float]:
    """The pool scheduler's clock, set ahead by the returned list's one value (seconds)."""
    from shoal.connectors.store import scheduler as store_scheduler

    ahead = [0.0]
    monkeypatch.setattr(store_scheduler, "time",
                        SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0]))
    return ahead


def test_blocks_found_in_the_pool_are_not_looked_up_again_for_a_while(
        tiny_model, workload, tmp_path, monkeypatch):
    """Deciding what to save looks a completed block up in the pool: a key found there is
    not looked up again for RECHECK_SECONDS (each 8k-token local prefix hit looked up its
    512 files again, ~2 ms), a key sent to be saved not for SAVE_RECHECK_SECONDS (its
    write may be queued still: no second save meanwhile), then once. Blocks never saved
    are looked up and saved: a chat's next turn saves the blocks of the last turn's
    answer, which its prompt now holds."""
    from shoal.connectors.store.scheduler import RECHECK_SECONDS, SAVE_RECHECK_SECONDS

    pool = tmp_path / "pool"
    turn1 = workload[1]  # 46 tokens: 11 full blocks
    clock = _scheduler_clock(monkeypatch)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        answer = llm.generate([turn1], SP)[0].token_ids  # saves blocks 0-10
        turn2 = turn1 + answer + random_prompts(512, [8], seed=9)[0]  # 64 tokens: 16 blocks
        keys: list[bytes] = []
        extend_block_keys(keys, turn2, 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
        paths = [pf.block_path_str(str(pool), k) for k in keys]
        assert not any(Path(p).is_file() for p in paths[11:])
        looked = count_lookups(monkeypatch)
        prompts = [turn2] + [turn2[:-4] + [i] * 4 for i in range(5, 9)]
        outs = [llm.generate([prompts[0]], SP)[0]]  # a local hit of 13 blocks (46 + 9 tokens)
        assert outs[0].num_local_prefix_tokens == 52
        assert not any(looked.get(p) for p in paths[:11])  # saved a moment ago
        assert all(looked.get(p) for p in paths[11:16])  # new: looked up, once, and saved,
        assert all(Path(p).is_file() for p in paths[:16])  # the answer's blocks too
        for ahead, looked_up in ((0.0, False), (SAVE_RECHECK_SECONDS + 1, True),
                                 (2 * SAVE_RECHECK_SECONDS + 2, False),
                                 (SAVE_RECHECK_SECONDS + RECHECK_SECONDS + 2, True)):
            looked.clear()
            clock[0] = ahead
            outs.append(llm.generate([prompts[len(outs)]], SP)[0])  # 15 blocks local
            assert outs[-1].num_local_prefix_tokens == 60
            # saved lately: not looked up; then once (found); found: not for a minute
            assert [looked.get(p, 0) for p in paths[:15]] == [int(looked_up)] * 15, ahead
        llm.check_integrity()
    with LLM(tiny_model, **KW) as llm:  # no pool: the same tokens
        assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, SP)]


def test_a_save_that_failed_is_made_again_once_it_would_have_ended(
        tiny_model, tmp_path, monkeypatch):
    """A full disk fails a request's saves; once it has room again, the next request whose
    local prefix holds those blocks after SAVE_RECHECK_SECONDS saves them (a key whose save
    was sent is not taken as in the pool), and one later saves again a block trimmed since
    it was saved."""
    from shoal.connectors.store.scheduler import SAVE_RECHECK_SECONDS

    pool = tmp_path / "pool"
    prompt = random_prompts(512, [40], seed=3)[0]  # 10 full blocks (with the answer's: 12)
    clock = _scheduler_clock(monkeypatch)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        keys: list[bytes] = []
        extend_block_keys(keys, prompt, 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
        paths = [Path(pf.block_path_str(str(pool), k)) for k in keys]
        real = FsStore.write

        def full_disk(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(FsStore, "write", full_disk)
        first = llm.generate([prompt], SP)[0]
        assert not any(p.is_file() for p in paths)
        monkeypatch.setattr(FsStore, "write", real)
        second = llm.generate([prompt + [1, 2, 3, 4, 5]], SP)[0]  # a local prefix hit
        assert second.num_local_prefix_tokens == 40
        assert not any(p.is_file() for p in paths)  # its saves may be queued still
        clock[0] = SAVE_RECHECK_SECONDS + 1
        llm.generate([prompt + [6, 7, 8, 9, 10]], SP)
        assert all(p.is_file() for p in paths)
        paths[3].unlink()  # trimmed (max_bytes) by another process
        clock[0] = 2 * SAVE_RECHECK_SECONDS + 2
        llm.generate([prompt + [1, 1, 1, 1, 1]], SP)
        assert paths[3].is_file()
        llm.check_integrity()
    with LLM(tiny_model, **KW) as llm:
        assert first.token_ids == llm.generate([prompt], SP)[0].token_ids


def test_a_long_hit_is_found_with_a_few_lookups_and_a_hole_in_it_is_recomputed(
        tiny_model, tmp_path, monkeypatch):
    """A request's run of 64 pool blocks: admission finds it with a binary search (the pool
    holds a prefix of a run, published front to back), not 64 lookups. A hole in it (a file
    trimmed by another process) is a hint gone wrong: the load fails there, the engine
    recomputes from it, and the block is saved again; the output is the baseline's."""
    prompt = random_prompts(512, [259], seed=21)[0]  # 64 full blocks of 4 before the last token
    with LLM(tiny_model, **KW) as llm:
        expected = llm.generate([prompt], SP)[0].token_ids
    pool = tmp_path / "pool"
    produce(tiny_model, pool, [prompt])
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        keys: list[bytes] = []
        extend_block_keys(keys, prompt, 4,
                          request_seed(bytes.fromhex(llm.engine.info.namespace), None))
        looked = count_lookups(monkeypatch)
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
    assert out.token_ids == expected and out.num_connector_tokens == 256
    paths = [pf.block_path_str(str(pool), k) for k in keys[:64]]
    assert sum(looked.get(p, 0) for p in paths) <= 10  # first, last, 8 probes between
    monkeypatch.undo()
    hole = Path(paths[40])
    hole.unlink()
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        out = llm.generate([prompt], SP)[0]
        s = llm.stats()
        llm.check_integrity()
    assert out.token_ids == expected
    assert out.num_connector_tokens == 160 and s["missing_blocks"] == 1  # blocks 0-39 loaded
    assert hole.is_file()  # recomputed and saved again: the next hit is whole


@pytest.mark.parametrize("group", [1, 2])
def test_a_run_s_lookup_finds_where_its_held_prefix_ends(tmp_path, group):
    """FsStore.contains stopping at a miss, on 64 blocks (of `group` shard keys each: TP):
    a whole run, a prefix, no first block, a hole in the middle (the probes find it: every
    block is then checked), and under TP a block only some of whose shards are held."""
    from shoal.connectors.fs.connector import FsStore
    pf.ensure_pool_dirs(tmp_path)
    store = FsStore(tmp_path)
    keys = [os.urandom(32) for _ in range(64 * group)]

    def hold(blocks, shards=range(group)):
        for path in (Path(pf.block_path_str(str(tmp_path), keys[b * group + r]))
                     for b in range(64) for r in range(group)):
            path.unlink(missing_ok=True)
        for b in blocks:
            for r in shards:
                path = Path(pf.block_path_str(str(tmp_path), keys[b * group + r]))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"x")

    def held() -> int:
        found = store.contains(keys, stop_at_miss=True, group=group)
        assert found == [True] * len(found[:-1]) + found[-1:] and len(found) % group in (0, 1)
        return sum(found) // group

    for blocks, expected in ((range(64), 64), (range(30), 30), (range(1, 64), 0),
                             ([*range(10), *range(21, 64)], 10)):
        hold(blocks)
        assert held() == expected, (list(blocks)[:12], expected)
    if group == 2:  # rank 0 holds blocks 0-39, rank 1 only 0-24
        hold(range(40), shards=[0])
        for b in range(25):
            path = Path(pf.block_path_str(str(tmp_path), keys[b * group + 1]))
            path.write_bytes(b"x")
        assert held() == 25


def test_missing_file_after_lookup_is_recomputed(tiny_model, workload, baseline, tmp_path,
                                                 monkeypatch):
    """A file that disappears between the lookup and the read (trimmed by another process)."""
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])
    real = pf.read_block_into
    calls = []

    def vanish_third(root, namespace, key, dest, shape, dtype, **kw):
        calls.append(key)
        if len(calls) == 3:
            raise pf.BlockMissing(key.hex())
        return real(root, namespace, key, dest, shape, dtype, **kw)

    cfg = whole_loads(pool, load_mode="sync")
    monkeypatch.setattr(pf, "read_block_into", vanish_third)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        out = llm.generate(workload[:1], SP)[0]
        s = llm.stats()
    # blocks are read last first, in one sync pass: the third read is block 7's
    assert out.token_ids == baseline[0] and out.num_connector_tokens == 28
    assert s["missing_blocks"] == 1 and s["load_failures_recomputed"] == 1


def test_load_failure_policy_fail_ends_only_that_request(tiny_model, workload, baseline, tmp_path):
    pool = tmp_path / "pool"
    produce(tiny_model, pool, workload[:1])
    for p in block_files(pool):
        _corrupt(p, "flipped_byte", pool)
    other = random_prompts(512, [9], seed=99)[0]
    cfg = ConnectorConfig(name="fs", options={"root": str(pool)}, load_failure_policy="fail",
                          compute_while_loading=False)
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        outs = llm.generate([workload[0], other], SP)
        llm.check_integrity()
    assert outs[0].finish_reason == "error" and "failed at block 0" in outs[0].error
    with LLM(tiny_model, **KW) as llm:
        assert outs[1].token_ids == llm.generate([other], SP)[0].token_ids


@pytest.mark.parametrize("failure", ["read_only", "disk_full"])
def test_failed_saves_are_counted_and_leave_no_temp_file(tiny_model, workload, baseline, tmp_path,
                                                        monkeypatch, failure):
    import errno
    pool = tmp_path / "pool"
    if failure == "read_only":
        real_open = os.open

        def refuse(path, flags, *a, **kw):
            if str(path).endswith(".tmp"):
                raise OSError(errno.EROFS, "Read-only file system", str(path))
            return real_open(path, flags, *a, **kw)
        monkeypatch.setattr(pf.os, "open", refuse)
    else:
        def full(src, dst, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(pf.os, "link", full)
    outs, s = produce(tiny_model, pool, workload)
    assert [o.token_ids for o in outs] == baseline
    assert all(o.finish_reason == "length" for o in outs)
    assert s["save_failures"] == 11 and s["blocks_saved"] == 0
    assert block_files(pool) == []
    assert [p for p in (pool / "blocks").rglob("*") if p.is_file()] == []  # no temp file left


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tiny_model, workload, baseline, tmp_path):
    pool = tmp_path / "pool"
    pf.ensure_pool_dirs(pool)
    (pool / "blocks").chmod(0o500)
    try:
        outs, s = produce(tiny_model, pool, workload)
    finally:
        (pool / "blocks").chmod(0o700)
    assert [o.token_ids for o in outs] == baseline and s["save_failures"] > 0


def test_pool_directories_are_owner_only(tiny_model, workload, tmp_path):
    pool = tmp_path / "new" / "pool"
    produce(tiny_model, pool, workload[:1])
    for d in (pool, pool / "blocks", pool / "quarantine"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for f in block_files(pool):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_max_bytes_trims_least_recently_used(tiny_model, tmp_path):
    pool = tmp_path / "pool"
    prompts = random_prompts(512, [41, 41, 41, 41], seed=21)  # 10 full blocks each
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    block_bytes = 3 * 2 * 4 * 2 * 16 * 4 + pf.HEADER_SIZE  # layers*kv*bs*heads*dim*4 + header
    cap = 25 * block_bytes
    cfg = ConnectorConfig(name="fs", options={"root": str(pool), "max_bytes": cap})
    with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
        outs = [llm.generate([p], SP)[0] for p in prompts]
    assert [o.token_ids for o in outs] == expected
    sizes = [p.stat().st_size for p in block_files(pool)]
    assert sizes and all(s == block_bytes for s in sizes)
    assert sum(sizes) <= cap


def test_bad_fs_options_fail_at_bring_up(tiny_model, tmp_path):
    for options, needle in [({}, "root"), ({"root": str(tmp_path), "load_mode": "later"}, "load_mode"),
                            ({"root": str(tmp_path), "io_threads": 0}, "io_threads"),
                            ({"root": str(tmp_path), "max_bytes": -1}, "max_bytes"),
                            ({"root": str(tmp_path), "host_tier_bytes": -1}, "host_tier_bytes"),
                            ({"root": str(tmp_path), "host_tier_bytes": "2G"}, "host_tier_bytes"),
                            ({"root": str(tmp_path), "colour": 1}, "unknown options")]:
        with pytest.raises(ValueError, match=needle):
            LLM(tiny_model, kv_connector=ConnectorConfig(name="fs", options=options), **KW)


@pytest.mark.parametrize("cpus, on_cpu, on_gpu, procs_on_gpu", [
    (1, 1, 1, 0), (2, 2, 2, 0), (6, 4, 6, 0), (8, 4, 4, 4), (16, 4, 4, 8), (40, 4, 4, 8)])
def test_io_threads_default_to_no_more_than_the_usable_cpus(tmp_path, monkeypatch, cpus,
                                                             on_cpu, on_gpu, procs_on_gpu):
    """Every read is verified on a CPU: more I/O threads than cores only contend. The
    default is 4 within the CPUs the process may use. With the KV cache on a GPU and 8 CPUs
    or more, half the CPUs (at most 8) are read processes by default and the threads stay
    4; with none (fewer CPUs, given, or under a read cap) the threads are 8. An explicit
    io_threads is kept."""
    from shoal.connectors.fs.connector import open_pool
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    root = str(tmp_path / "pool")
    on_cpu_pool = open_pool(ConnectorConfig(name="fs", options={"root": root}))
    assert (on_cpu_pool.shared.io_threads, on_cpu_pool.read_processes) == (on_cpu, 0)
    on_gpu_pool = open_pool(ConnectorConfig(name="fs", options={"root": root}), "cuda")
    assert (on_gpu_pool.shared.io_threads, on_gpu_pool.read_processes) == (on_gpu, procs_on_gpu)
    for no_procs in ({"read_processes": 0}, {"max_read_gbps": 5.0}):
        threads_only = open_pool(ConnectorConfig(name="fs", options={"root": root, **no_procs}),
                                 "cuda")
        assert threads_only.read_processes == 0
        assert threads_only.shared.io_threads == min(8, cpus)
    given = ConnectorConfig(name="fs", options={"root": root, "io_threads": 6})
    assert open_pool(given).shared.io_threads == 6
