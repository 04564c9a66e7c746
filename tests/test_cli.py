"""The `shoal` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def shoal(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shoal", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json_on_smollm2(smollm2_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nName three primary colors.\n")
    r = shoal("generate", "--model", smollm2_path, "--prompts-file", str(prompts), "--chat",
              "--max-tokens", "16", "--json", "--num-kv-blocks", "128")
    assert r.returncode == 0, r.stderr
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


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "x", "--block-size", "0"], "block_size"),
    (["generate", "--prompt", "x", "--max-tokens", "-3"], "max_tokens"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/model"], "neither a preset"),
    (["generate"], "no prompts"),
])
def test_bad_input_is_one_clear_line_and_exit_2(args, needle):
    r = shoal(*args)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_help_lists_the_commands():
    r = shoal("--help")
    assert r.returncode == 0
    for cmd in ("generate", "demo", "bench"):
        assert cmd in r.stdout
