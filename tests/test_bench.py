"""`shoal bench ...` end to end: each bench's command runs and prints its JSON line (the
figures are the benches' own and not asserted; what is asserted is what a run must show)."""

from __future__ import annotations

import json
import math

import pytest

from tests.test_cli import shoal


def test_bench_pool_io_runs_and_reports_ratios():
    """`shoal bench pool-io` end to end on a few blocks (the figures are the bench's, not
    asserted): it checks the loaded bytes itself and prints one JSON line."""
    r = shoal("bench", "pool-io", "--num-blocks", "8", "--rounds", "1", "--threads", "2")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["num_blocks"] == 8 and result["threads"] == 2
    assert result["load_gbps"] > 0 and result["save_gbps"] > 0 and result["load_over_raw"] > 0


@pytest.mark.parametrize("grammar", ["regex", pytest.param("json", marks=pytest.mark.extended)])
def test_bench_structured_runs_free_and_constrained(grammar):
    """`shoal bench structured`: both runs decode every token, the constrained outputs
    match their grammar; the ratio is the bench's figure (not asserted); a checkpoint
    without a tokenizer is refused in one line."""
    r = shoal("bench", "structured", "--num-prompts", "2", "--max-tokens", "6", "--rounds", "1",
              "--grammar", grammar, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["grammar"] == grammar and result["outputs_matching"] == 1.0
    assert result["free_decode_tokens_per_s"] > 0 and result["constrained_over_free"] > 0
    r = shoal("bench", "structured", "--model", "random:smollm2-135m")
    assert r.returncode == 2 and "tokenizer" in r.stderr


def test_bench_serve_with_an_engine_process(smollm2_path):
    """`shoal bench serve`: its servers (here with --engine-process) with the pool off, on
    and restarted on it, and the library, all answer every request; the restart finds the
    first phases' prefixes in the pool."""
    r = shoal("bench", "serve", "--model", smollm2_path, "--engine-process", "--clients", "2",
              "--docs", "1", "--doc-tokens", "96", "--questions", "2", "--chats", "1",
              "--turns", "2", "--max-tokens", "4", "--num-kv-blocks", "256")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["requests"] == 4  # 2 questions + 2 turns
    assert result["engine_process"] is True  # (on a CPU only when asked)
    assert result["cached_share_warm"] > result["cached_share_off"]
    assert result["ttft_p50_on_over_off"] > 0 and result["tpot_p50_server_over_library"] > 0
    header = r.stdout.splitlines()[0].split()
    table = {line.split("  ")[0]: dict(zip(header[1:], line.split()[1 - len(header):]))
             for line in r.stdout.splitlines()[1:-1]}
    assert {name: row["requests"] for name, row in table.items()} == {
        "pool off": "4", "decode (server)": "4", "pool on": "4", "warm restart": "4",
        "library": "4", "decode (library)": "4"}
    for name, row in table.items():  # each server phase's TTFT as its server saw it
        means = {key: float(row[key]) for key in ("ttft_mean", "srv_ttft",
                                                  "srv_queue", "srv_prefill")}
        if name in ("library", "decode (library)"):
            assert math.isnan(means["srv_ttft"])
            continue
        # the engine's first token, then the server's, then the client's: in that order
        # (within the table's rounding to 3 decimals: the first two are < 1 ms apart)
        engine_first = means["srv_queue"] + means["srv_prefill"]
        assert 0 < engine_first <= means["srv_ttft"] + 2e-3, (name, means)
        assert means["srv_ttft"] <= means["ttft_mean"] + 1e-3, (name, means)


def test_bench_serve_against_a_running_server(smollm2_path):
    """`--url URL --served-model-name NAME`: one run against a server started elsewhere,
    under the name it serves (a wrong name would be refused, and so every request)."""
    from shoal.bench.serve import ServerProcess
    server = ServerProcess(smollm2_path, ["--served-model-name", "harbor", "--num-kv-blocks",
                                          "256"])
    try:
        r = shoal("bench", "serve", "--url", server.url, "--served-model-name", "harbor",
                  "--clients", "1", "--docs", "1", "--doc-tokens", "64", "--questions", "2",
                  "--chats", "0", "--max-tokens", "3")
    finally:
        code = server.stop()
    assert r.returncode == 0, r.stderr[-2000:]
    assert code == 0
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["url"] == server.url and result["requests"] == 2
    assert result["cached_share"] > 0  # the second question (one client) found the document


@pytest.mark.extended
def test_bench_ttft_with_two_owners_and_on_a_tp_fleet():
    """`--dp 2`: the second owner of a fresh fleet loads what the first one's saved (a
    checkpoint with no tokenizer too); `--tp 3`: every engine a TP fleet, the pool hit the
    same; --dp with a flag of the one-fleet bench is refused, naming it."""
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--dp", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["dp"] == 2 and result["blocks_saved_per_owner_cold"][0] > 0
    assert result["tokens_loaded_per_owner_warm"][1] == 48  # owner 0's saves: 3 full blocks
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--rounds", "1", "--tp", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["tokens_loaded"] == 48 and result["ttft_pool_s"] > 0
    r = shoal("bench", "ttft", "--dp", "2", "--tp", "3", "--source", "tier")
    assert r.returncode == 2 and "without --tp, --source" in r.stderr


@pytest.mark.extended
def test_bench_serve_on_dp2_servers(smollm2_path):
    r = shoal("bench", "serve", "--model", smollm2_path, "--dp", "2", "--clients", "2",
              "--docs", "1", "--doc-tokens", "64", "--questions", "2", "--chats", "0",
              "--max-tokens", "3", "--num-kv-blocks", "256", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["requests"] == 2 and result["cached_share_warm"] > result["cached_share_off"]


@pytest.mark.extended  # the tier's test runs a random checkpoint too
def test_bench_ttft_on_a_random_checkpoint():
    """`shoal bench ttft --model random:<shape>`: random token prompts (no tokenizer), the
    pool loads every full block but the last token's."""
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--rounds", "1")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["prompt_tokens"] == 64 and result["tokens_loaded"] == 48
    assert result["bytes_loaded"] > 0 and result["ttft_pool_s"] > 0
    assert result["source"] == "files" and result["split"]["decision"] in ("load", "split", "compute")
    assert 0 < result["ttft_floor_s"] <= min(result["ttft_recomputed_s"], result["ttft_load_only_s"])


def test_bench_ttft_from_the_tier_with_capped_reads():
    """`--source tier --pool-read-gbps X --block-size 32`: the hit comes from the host tier
    (loaded once before: the cap on file reads does not apply to it), all three ways timed,
    in 32-token blocks (the pool holds the prompt's first block: the second has its last
    token)."""
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--rounds", "1", "--source", "tier", "--pool-read-gbps", "0.5",
              "--block-size", "32", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["source"] == "tier" and result["pool_read_gbps"] == 0.5
    assert result["block_size"] == 32 and "32-token blocks" in r.stdout
    assert result["tokens_loaded"] == 32 and "reads capped at 0.5 GB/s" in r.stdout
    hit = result["split"]
    assert hit["front_tokens"] + hit["loaded_tokens"] == 32
    assert hit["host_tokens"] == 32  # the engine expected all of it from host memory


def test_bench_ttft_refuses_a_block_size_below_one():
    r = shoal("bench", "ttft", "--block-size", "0")
    assert r.returncode == 2 and "--block-size: must be at least 1, got 0" in r.stderr


def test_bench_ttft_first_hit_on_a_dead_slow_store():
    """`--skip-load-only` with reads capped far below computing (a block in 70 s): the first
    engine knows no load rate, waits briefly for a first block that does not come and
    computes it all; the next one expects at most the rate the first saw, and once its
    block is overdue computes it all too. Neither waits for the store (the test would
    take minutes)."""
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--rounds", "2", "--pool-read-gbps", "0.00001", "--skip-load-only")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    first, second = result["hits"]
    assert result["load_only"] == "skipped" and "no load rate known yet" in r.stdout
    assert first == {"decision": "load", "front_tokens": 48, "loaded_tokens": 0}
    assert second["front_tokens"] == 48 and second["loaded_tokens"] == 0


def test_bench_pool_io_and_ttft_on_a_redis_pool(redis_url):
    """`--pool redis://...`: pool-io against the client's raw SET / GET of the same values,
    ttft with the hit from Redis; each bench leaves no names of its own behind."""
    import redis
    client = redis.Redis.from_url(redis_url)
    r = shoal("bench", "pool-io", "--pool", redis_url, "--num-blocks", "8", "--rounds", "1",
              "--threads", "2")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["pool"] == "redis" and result["num_blocks"] == 8 and result["threads"] == 2
    assert result["load_over_raw"] > 0 and result["save_over_raw"] > 0
    r = shoal("bench", "ttft", "--model", "random:smollm2-135m", "--prefix-tokens", "64",
              "--rounds", "1", "--pool", redis_url)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["pool"] == "redis" and result["tokens_loaded"] == 48
    assert "hits from redis" in r.stdout
    assert client.dbsize() == 0


def test_bench_adp_against_tp_on_latent_attention(tiny_moe_models):
    """`shoal bench adp --against tp`: with MLA every TP rank keeps the whole latent, so dp 2
    holds twice the tokens of tp 2 in the same KV memory; both give the same tokens."""
    r = shoal("bench", "adp", "--model", str(tiny_moe_models["deepseek_v3"]), "--against", "tp",
              "--size", "2", "--kv-cache-gb", "0.001", "--num-prompts", "4", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    tp, dp = result["runs"]
    assert (tp["fleet"], dp["fleet"]) == ("tp=2", "dp=2") and result["identical_outputs"]
    # 0.001 GiB / (3 layers x 16 tokens x 40 x 4 bytes) = 139 blocks a rank
    assert tp["kv_capacity_tokens"] == 139 * 16 and dp["kv_capacity_tokens"] == 2 * 139 * 16
    assert result["kv_capacity_dp_over_base"] == 2.0 and tp["tokens_per_s"] > 0


def test_bench_throughput_against_transformers(tiny_models):
    """`shoal bench throughput` (`make bench`) on random-token prompts: both engines produce
    every token, the long prompt's second run is a local prefix hit."""
    r = shoal("bench", "throughput", "--model", str(tiny_models["gqa_tied"]), "--num-prompts",
              "3", "--max-tokens", "5", "--prompt-len", "20", "--rounds", "2", "--device", "cpu",
              "--dtype", "bfloat16", "--enforce-eager")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["bench"] == "throughput" and result["rounds"] == 2
    assert result["dtype"] == "torch.bfloat16" and result["enforce_eager"] is True
    assert result["shoal_tokens_per_s"] > 0 and result["transformers_tokens_per_s"] > 0
    # the long prompt fits the tiny model's 1024-token context
    assert result["prefix_hit_tokens"] > 0 and result["long_prompt_tokens"] == 1023


def test_bench_adp_against_one_rank(tiny_models):
    r = shoal("bench", "adp", "--model", str(tiny_models["gqa_tied"]), "--num-prompts", "4",
              "--max-tokens", "6", "--kv-cache-gb", "0.01", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    one, two = result["runs"]
    assert (one["fleet"], two["fleet"]) == ("dp=1", "dp=2") and result["identical_outputs"]
    assert two["control_collectives_per_step"] == 1.0  # one small all-gather a step
    assert result["kv_capacity_dp_over_base"] == 2.0  # two owners, two caches
