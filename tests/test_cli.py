"""The `shoal` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from dataclasses import fields

import pytest


def shoal(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json_on_smollm2(smollm2_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName three primary colors.\n")
    r = shoal("generate", "--model", smollm2_path, "--prompts-file", str(prompts), "--chat",
              "--max-tokens", "16", "--json", "--num-kv-blocks", "128", "--engine-process")
    assert r.returncode == 0, r.stderr  # (the engine in a process of its own: the same text)
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["index"] for line in lines[:-1]] == [0, 1]
    assert "Paris" in lines[0]["text"] and "Blue" in lines[1]["text"]
    for line in lines[:-1]:
        assert set(line) >= {"index", "text", "token_ids", "finish_reason", "ttft_s",
                             "num_local_prefix_tokens", "num_connector_tokens"}
        assert line["finish_reason"] == "stop"
    summary = lines[-1]["summary"]
    assert summary["generated_tokens"] == sum(len(x["token_ids"]) for x in lines[:-1])
    assert len(summary["per_rank"]) == 1


def test_generate_s_sampling_and_engine_flags_reach_the_run(smollm2_path, smollm2):
    """`generate --temperature --top-p --top-k --seed` draws the library's tokens for the same
    SamplingParams (a seeded request draws the same in any engine), on an engine run with
    the engine flags given; -v prints INFO lines, the engine's ready line among them (its
    blocks: 64 of 32 tokens in float32). The effects of --max-batch-size, --max-num-tokens
    and --no-overlap are asserted on a server (test_serve.py; one parser for both)."""
    from shoal import SamplingParams
    prompt = "The old harbor at night was"
    r = shoal("-v", "generate", "--model", smollm2_path, "--prompt", prompt, "--max-tokens", "10",
              "--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--seed", "7",
              "--no-overlap", "--max-batch-size", "4", "--max-num-tokens", "128",
              "--block-size", "32", "--dtype", "float32", "--enforce-eager",
              "--num-kv-blocks", "64", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[0])["token_ids"]
    want = smollm2.generate([prompt], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9,
                                                     top_k=20, seed=7))[0].token_ids
    greedy = smollm2.generate([prompt], SamplingParams(max_tokens=10))[0].token_ids
    assert got == want and got != greedy
    assert re.search(r" INFO .*engine ready: 64 KV blocks of 32 tokens \(90\.0 MiB\)", r.stderr)


@pytest.mark.extended  # (`make demo` runs the demo itself)
def test_demo_keeps_its_pool_in_the_directory_given(tmp_path):
    """`shoal demo --kv-pool DIR --no-overlap`: the demo's cold and warm fleets agree, the
    pool stays in DIR, and a second demo on it loads the handbook already in its cold run."""
    pool = tmp_path / "pool"
    first = shoal("demo", "--kv-pool", str(pool), "--no-overlap", timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "outputs identical cold vs warm             yes" in first.stdout
    assert str(pool) in first.stdout and any(pool.rglob("*.kv"))
    second = shoal("demo", "--kv-pool", str(pool), timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    saved = int(re.search(r"blocks saved by the cold run +(\d+)", second.stdout).group(1))
    assert saved < int(re.search(r"blocks saved by the cold run +(\d+)", first.stdout).group(1))


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "x", "--block-size", "0"], "block_size"),
    (["generate", "--prompt", "x", "--max-tokens", "-3"], "max_tokens"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/model"], "neither a preset"),
    (["generate"], "no prompts"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace"),
    (["serve", "--max-body-bytes", "0"], "--max-body-bytes"),
    (["serve", "--max-concurrent-requests", "0"], "--max-concurrent-requests"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--read-timeout", "-1"], "--read-timeout"),
])
def test_bad_input_is_one_clear_line_and_exit_2(args, needle):
    r = shoal(*args)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_on_an_address_it_cannot_take_is_one_line_and_exit_1():
    """Checked before the model loads: a port in use, a host that is not this machine's."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for args, needle in ((["--port", port], f"127.0.0.1:{port}"),
                             (["--host", "203.0.113.1"], "203.0.113.1:8000")):
            r = shoal("serve", "--model", "/nonexistent/model", *args)
            assert r.returncode == 1, r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and f"cannot listen on {needle}" in lines[0], r.stderr


# every option `shoal serve --help` lists; each is exercised: the engine's below (parsed;
# most also in real servers in test_serve.py, --tp and --dp in test_parallel.py), the
# server's in real servers in test_serve.py (--host, --port,
# --served-model-name, --shutdown-grace, --access-log, --api-key, --max-body-bytes,
# --max-concurrent-requests, --max-queue, --read-timeout), and above (bad --port,
# --shutdown-grace, --max-body-bytes and the limits, an address in use)
SERVE_OPTIONS = {
    "--model", "--dp", "--tp", "--kv-pool", "--block-size", "--max-batch-size",
    "--max-num-tokens", "--num-kv-blocks", "--kv-cache-gb", "--no-overlap", "--device",
    "--dtype", "--enforce-eager", "--engine-process", "--no-engine-process", "--host", "--port", "--served-model-name",
    "--shutdown-grace", "--access-log", "--api-key", "--max-body-bytes",
    "--max-concurrent-requests", "--max-queue", "--read-timeout"}


def test_serve_help_lists_only_tested_options():
    r = shoal("serve", "--help")
    assert r.returncode == 0
    assert set(re.findall(r"--[a-z][a-z-]*", r.stdout)) - {"--help"} == SERVE_OPTIONS


def test_serve_limit_flags_reach_the_server_limits():
    """--read-timeout 0 turns the timer off; the places default to the engine's batch
    (max batch size x data-parallel ranks) running and as many waiting."""
    from shoal.cli import _server_limits, build_parser
    args = build_parser().parse_args(["serve", "--read-timeout", "0", "--max-body-bytes", "99"])
    limits = _server_limits(args)
    assert limits.read_timeout_s is None and limits.max_body_bytes == 99
    assert limits.places(64 * 2) == (128, 128)
    args = build_parser().parse_args(["serve", "--max-concurrent-requests", "3", "--max-queue", "0"])
    assert _server_limits(args).places(64) == (3, 0)
    assert _server_limits(build_parser().parse_args(["serve"])).read_timeout_s == 30.0


def test_engine_flags_reach_the_engine_config():
    from shoal.config import EngineConfig
    from shoal.cli import _engine_kwargs, build_parser
    args = build_parser().parse_args([
        "serve", "--dp", "2", "--tp", "3", "--kv-pool", "/p", "--block-size", "8",
        "--max-batch-size", "4", "--max-num-tokens", "64", "--num-kv-blocks", "32",
        "--kv-cache-gb", "0.5", "--no-overlap", "--device", "cuda:1", "--dtype", "bfloat16",
        "--enforce-eager", "--engine-process"])
    assert _engine_kwargs(args) == dict(
        kv_pool="/p", dp_size=2, tp_size=3, block_size=8, max_batch_size=4, max_num_tokens=64,
        num_kv_blocks=32, kv_cache_gb=0.5, overlap_scheduler=False, device="cuda:1",
        dtype="bfloat16", enforce_eager=True, engine_process=True)
    # without flags: EngineConfig's own defaults
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    kwargs = _engine_kwargs(build_parser().parse_args(["serve"]))
    assert kwargs.pop("kv_pool") is None
    assert kwargs == {k: defaults[k] for k in kwargs}


def test_serve_and_generate_build_their_engine_by_that_rule(monkeypatch):
    """The commands pass the rule on: `shoal serve --device cuda` builds an LLM with its
    engine in a process of its own, `shoal generate --device cuda` one without (no GPU
    here: the LLM is replaced by a stand-in that records its keywords and refuses)."""
    import socket

    import shoal
    from shoal.cli import main

    built = []

    def llm(model, **kw):
        built.append(kw["engine_process"])
        raise ValueError("not built here")

    monkeypatch.setattr(shoal, "LLM", llm)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert main(["serve", "--model", "m", "--device", "cuda", "--port", port]) == 2
    assert main(["generate", "--model", "m", "--device", "cuda", "--prompt", "x"]) == 2
    assert main(["serve", "--model", "m", "--device", "cuda", "--port", port,
                 "--no-engine-process"]) == 2
    assert built == [True, False, False]


def test_shoal_serve_runs_its_engine_in_a_process_of_its_own_on_a_gpu():
    """On a GPU the server's Python slows the engine's launches (on an H100 the server's
    TPOT was 1.56x the library's in process, 0.78-1.13x with the engine in its own): `shoal
    serve --device cuda` runs it in its own unless --no-engine-process; on a CPU, and for
    `shoal generate`, it stays in process unless --engine-process. `shoal bench serve`
    passes either flag to its servers, or neither (their default)."""
    from shoal.bench.serve import server_args
    from shoal.cli import _engine_kwargs, build_parser

    def process(*argv: str, serving: bool = True) -> bool:
        return _engine_kwargs(build_parser().parse_args(argv), serving)["engine_process"]

    assert process("serve", "--device", "cuda") is process("serve", "--device", "cuda:1") is True
    assert process("serve", "--device", "cuda", "--no-engine-process") is False
    assert process("serve") is False and process("serve", "--engine-process") is True
    assert process("generate", "--device", "cuda", serving=False) is False
    assert process("generate", "--device", "cuda", "--no-engine-process", serving=False) is False
    assert process("generate", "--engine-process", serving=False) is True
    for flag, expected in (([], []), (["--engine-process"], ["--engine-process"]),
                           (["--no-engine-process"], ["--no-engine-process"])):
        bench = build_parser().parse_args(["bench", "serve", "--device", "cuda", *flag])
        given = [a for a in server_args(bench) if a.endswith("engine-process")]
        assert given == expected


def test_serve_takes_the_api_key_from_the_environment(monkeypatch):
    """SHOAL_API_KEY is --api-key's default; the flag wins over it."""
    from shoal.cli import build_parser
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("SHOAL_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_help_lists_the_commands():
    r = shoal("--help")
    assert r.returncode == 0
    for cmd in ("generate", "demo", "bench"):
        assert cmd in r.stdout


def _make_pool(tiny_model, pool):
    from shoal import LLM, SamplingParams
    from tests.conftest import random_prompts
    with LLM(tiny_model, kv_pool=str(pool), block_size=4, num_kv_blocks=64) as llm:
        llm.generate(random_prompts(512, [21, 13]), SamplingParams(max_tokens=2))


def test_pool_stats_verify_gc(tiny_model, tmp_path):
    from shoal.connectors.fs import format as pf
    pool = tmp_path / "pool"
    _make_pool(tiny_model, pool)  # 5 + 3 full prompt blocks
    r = shoal("pool", "stats", str(pool), "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["num_blocks"] == 8 and stats["num_quarantined"] == 0
    r = shoal("pool", "verify", str(pool))
    assert r.returncode == 0 and "8 blocks ok, 0 corrupt" in r.stdout
    victim = next(pf.iter_block_files(pool))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = shoal("pool", "verify", str(pool), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ok_blocks"] == 7 and report["corrupt"] == [{"file": victim.name, "reason": "checksum"}]
    assert not victim.exists() and len(list((pool / "quarantine").iterdir())) == 1
    size = len(data)
    r = shoal("pool", "gc", str(pool), "--max-bytes", str(3 * size), "--json")
    assert r.returncode == 0, r.stderr
    gc = json.loads(r.stdout)
    assert gc["num_bytes"] <= 3 * size and gc["trimmed_blocks"] == 7 - gc["num_blocks"]


def test_pool_command_on_a_non_pool_is_a_clear_error(tmp_path):
    r = shoal("pool", "stats", str(tmp_path))
    assert r.returncode == 2 and "not a Shoal KV pool" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dir", pytest.param("redis", marks=pytest.mark.extended)])
def test_generate_with_kv_pool_reuses_across_runs(smollm2_path, tmp_path, kind, request):
    prompt = "Summarize: " + "The harbor gate opens at dawn and closes at dusk. " * 12
    pool = str(tmp_path / "pool") if kind == "dir" else request.getfixturevalue("redis_url")
    args = ("generate", "--model", smollm2_path, "--prompt", prompt, "--max-tokens", "8",
            "--json", "--num-kv-blocks", "64", "--kv-pool", pool)
    first, second = shoal(*args), shoal(*args)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = (json.loads(r.stdout.splitlines()[0]) for r in (first, second))
    assert a["token_ids"] == b["token_ids"]
    assert a["num_connector_tokens"] == 0 and a["pool_hit"] is None
    hit = b["pool_hit"]  # loaded, or computed where that was faster: every token once
    assert hit["num_matched_tokens"] > 100 and hit["decision"] in ("load", "split", "compute")
    assert hit["num_front_tokens"] + hit["num_loaded_tokens"] == hit["num_matched_tokens"]
    assert b["num_connector_tokens"] == hit["num_loaded_tokens"]
    assert json.loads(second.stdout.splitlines()[-1])["summary"]["pool_hit_blocks"] > 5


@pytest.mark.slow
def test_ctrl_c_on_a_dp2_run_is_one_line(smollm2_path):
    import os
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal", "generate", "--model", smollm2_path, "--dp", "2",
         "--chat", "--prompt", "Write a very long story about a lighthouse keeper.",
         "--max-tokens", "2000", "--num-kv-blocks", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        # as from a terminal: a run started in the background inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    while b"requests" not in seen:  # the progress bar: the fleet is up and generating
        chunk = os.read(proc.stderr.fileno(), 4096)
        assert chunk, seen.decode(errors="replace")
        seen += chunk
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    _, rest = proc.communicate(timeout=120)
    err = (seen + rest).decode(errors="replace")
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "requests" not in x]
    assert proc.returncode == 130, err
    assert lines == ["shoal: interrupted"], err


def test_a_ctrl_c_ends_the_progress_bar_line_first():
    """A Ctrl-C may land while `generate`'s bar is being made (before it can close it): the
    handler closes every bar still drawn, so "shoal: interrupted" starts its own line."""
    import io

    from tqdm import tqdm

    from shoal.cli import _end_progress_bars

    out = io.StringIO()
    tqdm(total=3, desc="requests", file=out)  # drawn, never closed
    _end_progress_bars()
    assert out.getvalue().startswith("\rrequests") and out.getvalue().endswith("\n")
    assert not tqdm._instances


@pytest.mark.slow
def test_an_error_inside_a_rank_is_one_line(smollm2_path):
    """A rank that cannot build its engine (a KV cache no machine holds): exit 1, one line."""
    r = shoal("generate", "--model", smollm2_path, "--dp", "2", "--prompt", "hi",
              "--kv-cache-gb", "1000000")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank" in lines[0] and "restart is required" in lines[0], r.stderr
