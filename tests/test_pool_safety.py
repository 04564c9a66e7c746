"""The fs pool never reaches outside its directory, and one bad file never stops the engine.

Hostile pools: links and special files where Shoal expects its own directories and files,
misnamed entries, headers that lie about sizes, read-only pools with a corrupt file, and
pool paths that cannot be directories. Every test that plants a link checks that nothing
outside the pool changed (names, sizes, contents, mtimes).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tracemalloc
from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.connectors.fs import admin
from shoal.connectors.fs import format as pf
from tests.conftest import random_prompts
from tests.test_cli import shoal

SP = SamplingParams(max_tokens=10)
KW = dict(block_size=4, num_kv_blocks=128)
NS = b"n" * 32
as_root = pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(512, [43], seed=7)[0]  # 10 full blocks of 4 are looked up


@pytest.fixture(scope="module")
def expected(tiny_model, prompt):
    with LLM(tiny_model, **KW) as llm:
        return llm.generate([prompt], SP)[0].token_ids


@pytest.fixture(scope="module")
def warm_pool(tiny_model, prompt, tmp_path_factory):
    pool = tmp_path_factory.mktemp("warm") / "pool"
    run(tiny_model, pool, prompt)
    return pool


@pytest.fixture
def pool(warm_pool, tmp_path):
    """A private copy of a pool holding the prompt's 10 blocks."""
    return Path(shutil.copytree(warm_pool, tmp_path / "pool"))


@pytest.fixture
def outside(warm_pool, tmp_path):
    """A directory outside the pool, full of real block files a follower would use."""
    return Path(shutil.copytree(warm_pool / "blocks", tmp_path / "outside"))


def whole_loads(pool) -> "ConnectorConfig":
    """The fs pool with every hit loaded whole (a split depends on measured rates)."""
    from shoal.connectors import ConnectorConfig
    return ConnectorConfig(name="fs", options={"root": str(pool)}, compute_while_loading=False)


def run(model, pool, prompt, **kw):
    with LLM(model, **{"kv_connector": whole_loads(pool), **KW, **kw}) as llm:
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
        return out, llm.stats()


def snapshot(d: Path) -> dict:
    """Every entry below d (links not followed): kind, size, mtime and contents of files."""
    snap = {}
    for dirpath, dirs, files in os.walk(d):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            body = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            snap[str(p.relative_to(d))] = (st.st_mode, st.st_size, st.st_mtime_ns, body)
    return snap


def one_line_error(r, code=2) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


def first_block(pool: Path) -> Path:
    return next(pf.iter_block_files(pool))


# -- links inside the pool ---------------------------------------------------------------

def test_symlinked_block_dirs_are_never_followed(tiny_model, prompt, expected, tmp_path,
                                                 outside):
    """Every blocks/<xx> a link to a directory of valid blocks: reads miss, saves fail (counted,
    not fatal), and the tools skip them; nothing outside changes."""
    pool = tmp_path / "victim"
    pf.ensure_pool_dirs(pool)
    for i in range(256):
        sub = f"{i:02x}"
        (outside / sub).mkdir(exist_ok=True)
        (pool / "blocks" / sub).symlink_to(outside / sub, target_is_directory=True)
    victim = next(p for p in sorted(outside.rglob("*.kv")))
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")  # verify would quarantine it
    before = snapshot(outside)
    out, s = run(tiny_model, pool, prompt)
    assert out.token_ids == expected and out.num_connector_tokens == 0
    assert s["pool_hit_blocks"] == 0 and s["blocks_saved"] == 0 and s["save_failures"] == 10
    r = shoal("pool", "verify", str(pool), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["ok_blocks"] == 0 and report["corrupt"] == []
    assert len(report["skipped"]) == 256
    assert {e["reason"] for e in report["skipped"]} == {"symbolic link"}
    r = shoal("pool", "gc", str(pool), "--max-bytes", "1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["trimmed_blocks"] == 0, r.stderr
    r = shoal("pool", "stats", str(pool), "--json")
    assert json.loads(r.stdout)["num_skipped"] == 256
    assert snapshot(outside) == before


@pytest.mark.parametrize("what", ["link to a directory", "dangling link", "regular file"])
def test_block_dir_that_is_not_a_directory(tmp_path, what):
    """Reads miss, writes and quarantines raise OSError (a save failure), nothing followed."""
    key = bytes.fromhex("ab" + "00" * 31)
    pf.ensure_pool_dirs(tmp_path / "pool")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sub = tmp_path / "pool" / "blocks" / "ab"
    if what == "regular file":
        sub.write_bytes(b"x")
    else:
        sub.symlink_to(elsewhere if what == "link to a directory" else tmp_path / "nowhere")
    data = memoryview(bytearray(64))
    with pytest.raises(OSError, match="never follows links"):
        pf.write_block(tmp_path / "pool", NS, key, data, (16,), torch.float32)
    with pytest.raises(pf.BlockMissing):
        pf.read_block_into(tmp_path / "pool", NS, key, data, (16,), torch.float32)
    with pytest.raises(OSError):
        pf.quarantine(tmp_path / "pool", key, "checksum")
    assert not pf.is_block_file(pf.block_path_str(str(tmp_path / "pool"), key))
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "nowhere").exists()


def test_symlinked_quarantine_is_refused_at_bring_up(tiny_model, pool, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    shutil.rmtree(pool / "quarantine")
    (pool / "quarantine").symlink_to(elsewhere)
    before = snapshot(elsewhere)
    with pytest.raises(ValueError, match="kv_pool.*quarantine/ is a symbolic link"):
        LLM(tiny_model, kv_pool=str(pool), **KW)
    for cmd in ("stats", "verify", "gc"):
        assert "quarantine/ is a symbolic link" in one_line_error(shoal("pool", cmd, str(pool)))
    r = shoal("generate", "--model", tiny_model, "--prompt", "x", "--kv-pool", str(pool))
    assert "kv_pool" in one_line_error(r)
    assert snapshot(elsewhere) == before


def test_quarantine_replaced_by_a_link_while_running(tiny_model, prompt, expected, pool,
                                                     tmp_path):
    """A corrupt file that cannot be quarantined is counted, recomputed, left in place and
    never read again by this process (a second engine finds it a miss at lookup)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = snapshot(elsewhere)
    bad = first_block(pool)
    with LLM(tiny_model, kv_connector=whole_loads(pool), **KW) as llm:
        (pool / "quarantine").rmdir()
        (pool / "quarantine").symlink_to(elsewhere)
        bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
        out = llm.generate([prompt], SP)[0]
        llm.check_integrity()
        s = llm.stats()
    assert out.token_ids == expected
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    assert bad.is_file() and snapshot(elsewhere) == before
    (pool / "quarantine").unlink()
    (pool / "quarantine").mkdir()
    again, s2 = run(tiny_model, pool, prompt)
    assert again.token_ids == expected and s2["corrupt_blocks"] == 0
    assert again.num_connector_tokens == out.num_connector_tokens  # stops before the bad one
    assert bad.is_file()


def test_symlinked_blocks_dir_is_refused(tiny_model, pool, tmp_path):
    moved = Path(shutil.move(pool / "blocks", tmp_path / "moved"))
    (pool / "blocks").symlink_to(moved)
    before = snapshot(moved)
    with pytest.raises(ValueError, match="blocks/ is a symbolic link"):
        LLM(tiny_model, kv_pool=str(pool), **KW)
    for cmd in ("verify", "gc"):
        one_line_error(shoal("pool", cmd, str(pool), *(["--max-bytes", "0"] * (cmd == "gc"))))
    assert snapshot(moved) == before


def test_block_file_that_links_outside(tiny_model, prompt, expected, pool, tmp_path):
    """The link is a miss at lookup and is never read, touched, moved or deleted; the save of
    that block fails (counted); the tools skip it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = first_block(pool)
    target = Path(shutil.copy(link, elsewhere / "copy.kv"))
    link.unlink()
    link.symlink_to(target)
    os.utime(target, (1, 1))  # would be touched by a follower reading it (max_bytes set)
    before = snapshot(elsewhere)
    out, s = run(tiny_model, pool, prompt, kv_pool=None,
                 kv_connector=pf_config(pool, max_bytes=1 << 30))
    assert out.token_ids == expected and s["save_failures"] == 1
    assert s["corrupt_blocks"] == 0 and s["missing_blocks"] == 0
    data = memoryview(bytearray(target.stat().st_size - pf.HEADER_SIZE))
    with pytest.raises(pf.BlockMissing, match="not a regular file"):
        pf.read_block_into(pool, b"x" * 32, bytes.fromhex(link.stem), data, (len(data),),
                           torch.float32)
    target.write_bytes(target.read_bytes()[:-1] + b"\0")  # corrupt: a follower would move it
    before = snapshot(elsewhere)
    r = shoal("pool", "verify", str(pool), "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["skipped"] == [
        {"entry": str(link.relative_to(pool)), "reason": "symbolic link"}]
    r = shoal("pool", "gc", str(pool), "--max-bytes", "0")
    assert r.returncode == 0 and link.is_symlink()
    assert list(pf.iter_block_files(pool)) == []  # every regular block file trimmed
    assert snapshot(elsewhere) == before


def pf_config(pool, **options):
    from shoal.connectors import ConnectorConfig
    return ConnectorConfig(name="fs", options={"root": str(pool), **options})


def test_stale_temp_cleanup_removes_only_regular_temp_files(pool, tmp_path):
    sub = first_block(pool).parent
    target = tmp_path / "target"
    target.write_bytes(b"not yours")
    real = sub / f".{sub.name}{'0' * 62}.kv.1.0badc0de.tmp"
    real.write_bytes(b"half a block")
    link = sub / f".{sub.name}{'1' * 62}.kv.2.0badc0de.tmp"
    link.symlink_to(target)
    for p in (real, link, target):  # all stale, the link's target too
        os.utime(p, (1, 1), follow_symlinks=False)
    assert admin.remove_stale_temp_files(pool) == 1
    assert not real.exists() and link.is_symlink() and target.read_bytes() == b"not yours"


# -- special files -----------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_fifo_named_like_a_block_never_blocks(tiny_model, prompt, expected, pool, tmp_path):
    fifo = first_block(pool)
    key = bytes.fromhex(fifo.stem)
    fifo.unlink()
    os.mkfifo(fifo)
    data = memoryview(bytearray(64))
    with pytest.raises(pf.BlockMissing, match="FIFO"):  # past the lookup: still no wait
        pf.read_block_into(pool, NS, key, data, (16,), torch.float32)
    out, s = run(tiny_model, pool, prompt)
    assert out.token_ids == expected and s["save_failures"] == 1
    r = shoal("pool", "verify", str(pool), "--json", timeout=30)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["ok_blocks"] == 9 and report["corrupt"] == []
    assert report["skipped"] == [{"entry": str(fifo.relative_to(pool)), "reason": "FIFO"}]
    r = shoal("pool", "gc", str(pool), "--max-bytes", "0", timeout=30)
    assert r.returncode == 0 and stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.timeout(30)
def test_socket_named_like_a_block(pool, monkeypatch):
    path = first_block(pool)
    path.unlink()
    monkeypatch.chdir(path.parent)  # socket paths are limited to ~108 bytes
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path.name)
        with pytest.raises(pf.BlockMissing, match="not a regular file"):
            pf.read_block_into(pool, NS, bytes.fromhex(path.stem), memoryview(bytearray(64)),
                               (16,), torch.float32)
        report = admin.verify_pool(pool)
    assert report.num_ok == 9 and report.skipped == [(str(path.relative_to(pool)), "socket")]


# -- lying and misnamed files ------------------------------------------------------------

def _lying_file(pool: Path, claimed: int, actual: int, shape: tuple[int, ...] = (4,)) -> Path:
    """A block file with a valid header claiming `claimed` payload bytes of `shape` in
    float32, `actual` long (sparse: no disk used)."""
    key = bytes.fromhex("cd" * 32)
    path = pf.block_path(pool, key)
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        f.write(pf.encode_header(NS, key, shape, torch.float32, claimed, 0))
        f.truncate(pf.HEADER_SIZE + actual)
    return path


@pytest.mark.parametrize("claimed, actual, shape, reason", [
    (1 << 50, 4096, (4,), "length"),  # not what its shape makes: never read
    (1 << 40, 1 << 40, (1 << 19, 1 << 19), "length"),  # a sparse 1 TiB file: more than any block
    (1 << 30, 1 << 30, (1 << 28,), "checksum"),  # the largest block, streamed: 1 GiB never
])                                               # in memory
def test_verify_memory_stays_bounded(pool, claimed, actual, shape, reason):
    path = _lying_file(pool, claimed, actual, shape)
    tracemalloc.start()
    try:
        report = admin.verify_pool(pool)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * pf.VERIFY_CHUNK, peak
    assert report.num_ok == 10 and report.corrupt == [(path.name, reason)]
    assert not path.exists()  # quarantined
    dest = memoryview(bytearray(16))
    _lying_file(pool, claimed, actual, shape)
    with pytest.raises(pf.CorruptBlock, match="length|shape"):  # the engine's read: bounded too
        pf.read_block_into(pool, NS, bytes.fromhex("cd" * 32), dest, (4,), torch.float32)


def test_streamed_checksum_equals_the_one_shot_checksum(tmp_path):
    data = os.urandom(3 * pf.VERIFY_CHUNK + 12345)
    (tmp_path / "f").write_bytes(b"h" * 7 + data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert pf.checksum_of_file(fd, 7, len(data)) == pf.checksum(data)
        with pytest.raises(pf.CorruptBlock, match="truncated"):
            pf.checksum_of_file(fd, 7, len(data) + 1)
    finally:
        os.close(fd)


def test_misnamed_and_foreign_entries_are_reported_not_touched(pool):
    sub = first_block(pool).parent
    other = "00" if sub.name != "00" else "11"
    strays = {
        f"blocks/{sub.name}/notahexname.kv": "misnamed",
        f"blocks/{sub.name}/{sub.name}{'0' * 10}.kv": "misnamed",  # too short
        f"blocks/{sub.name}/{sub.name.upper()}{'A' * 62}.kv": "misnamed",
        f"blocks/{sub.name}/{other}{'0' * 62}.kv": "misnamed",  # in another key's directory
        f"blocks/{sub.name}/{sub.name}{'2' * 62}.kv": "directory",
        "blocks/zz": "misnamed directory",
        "blocks/stray.kv": "misplaced file",
    }
    for rel, kind in strays.items():
        (pool / rel).mkdir() if "directory" in kind else (pool / rel).write_bytes(b"junk" * 40)
    report = admin.verify_pool(pool)
    assert report.num_ok == 10 and report.corrupt == []
    assert sorted(report.skipped) == sorted(strays.items())
    assert admin.pool_stats(pool).num_skipped == len(strays)
    assert admin.trim_pool(pool, 0) == 10
    assert all((pool / rel).exists() for rel in strays)


# -- gc arguments ------------------------------------------------------------------------

def test_gc_refuses_a_negative_max_bytes(pool):
    before = snapshot(pool)
    assert "--max-bytes" in one_line_error(shoal("pool", "gc", str(pool), "--max-bytes", "-1"))
    assert snapshot(pool) == before
    with pytest.raises(ValueError, match="max_bytes"):
        admin.trim_pool(pool, -1)


def test_gc_max_bytes_zero_removes_every_block_file(pool):
    (pool / "quarantine" / "old.checksum.1.abc").write_bytes(b"q")
    r = shoal("pool", "gc", str(pool), "--max-bytes", "0", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["trimmed_blocks"] == 10 and result["num_blocks"] == 0
    assert result["num_quarantined"] == 1  # quarantine is left for a person to look at


# -- a read-only pool with a corrupt file ------------------------------------------------

def _make_read_only(pool: Path, mode: int) -> None:
    for d in [pool, *(p for p in pool.rglob("*") if p.is_dir())]:
        d.chmod(mode)


@as_root
def test_read_only_pool_with_a_corrupt_file(tiny_model, prompt, expected, pool):
    bad = first_block(pool)
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    _make_read_only(pool, 0o500)
    try:
        out, s = run(tiny_model, pool, prompt)
        again, s2 = run(tiny_model, pool, prompt)
        report = admin.verify_pool(pool)
    finally:
        _make_read_only(pool, 0o700)
    assert out.token_ids == expected == again.token_ids
    assert s["corrupt_blocks"] == 1 and s["load_failures_recomputed"] == 1
    assert s2["corrupt_blocks"] == 0  # remembered: never read again
    assert bad.is_file()
    assert report.corrupt == [(bad.name, "checksum")]
    assert report.not_quarantined == [(bad.name, "Permission denied")]


def test_corrupt_file_that_cannot_be_quarantined(tiny_model, prompt, expected, pool,
                                                 monkeypatch):
    """The same as a read-only pool, by refusing the rename (root ignores permissions)."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    bad = first_block(pool)
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    monkeypatch.setattr(pf.os, "rename", refuse)
    out, s = run(tiny_model, pool, prompt)
    again, s2 = run(tiny_model, pool, prompt)
    assert out.token_ids == expected == again.token_ids
    assert s["corrupt_blocks"] == 1 and s2["corrupt_blocks"] == 0 and s2["missing_blocks"] == 0
    assert again.num_connector_tokens == out.num_connector_tokens
    assert bad.is_file()
    report = admin.verify_pool(pool)
    assert report.corrupt == [(bad.name, "checksum")]
    assert report.not_quarantined == [(bad.name, "Permission denied")]


# -- pool paths that cannot be a pool ----------------------------------------------------

def _bad_pool_path(tmp_path: Path, case: str) -> Path:
    (tmp_path / "file").write_text("x")
    if case == "regular file":
        return tmp_path / "file"
    if case == "below a regular file":
        return tmp_path / "file" / "pool"
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    return ro / "pool"


CASES = ["regular file", "below a regular file",
         pytest.param("in a read-only directory", marks=as_root)]


@pytest.mark.parametrize("case", CASES)
def test_unusable_kv_pool_fails_at_bring_up(tiny_model, tmp_path, case):
    path = _bad_pool_path(tmp_path, case)
    with pytest.raises(ValueError, match="kv_pool.*cannot be used as a pool directory"):
        LLM(tiny_model, kv_pool=str(path), **KW)
    r = shoal("generate", "--model", tiny_model, "--prompt", "x", "--kv-pool", str(path))
    assert "kv_pool" in one_line_error(r) and str(path) in r.stderr


@pytest.mark.parametrize("cmd, case", [
    ("stats", "missing"), ("verify", "missing"), ("gc", "missing"),
    ("stats", "regular file"), ("verify", "below a regular file"), ("gc", "regular file")])
def test_pool_tools_on_a_non_pool(tmp_path, cmd, case):
    path = tmp_path / "missing" if case == "missing" else _bad_pool_path(tmp_path, case)
    assert "not a Shoal KV pool" in one_line_error(shoal("pool", cmd, str(path)))
    assert not (tmp_path / "missing").exists()
