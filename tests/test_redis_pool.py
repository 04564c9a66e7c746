"""The redis pool connector against real redis-server processes: sharing, restarts, bad
values, a store that is killed, full or refuses the password, TTLs, TLS, a cluster, the
pool tools, and ADP / TP fleets on one store. Outputs are compared with a run without a
pool every time."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.connectors.store.block_format import HEADER_SIZE, encode_header, parse_header
from tests.conftest import random_prompts
from tests.test_fs_pool import baseline, workload  # noqa: F401 (fixtures: the same workload)
from tests.redis_server import RedisServer, free_port, require_redis

SP = SamplingParams(max_tokens=10)
KW = dict(block_size=4, num_kv_blocks=128)  # as in test_fs_pool, whose workload this is
BLOCK = "shoal:{"


def whole(url: str, **options) -> ConnectorConfig:
    """Every hit loaded whole (these tests count what is loaded; the split of a hit between
    loading and computing depends on measured rates)."""
    return ConnectorConfig(name="redis", options={"url": url, **options},
                           compute_while_loading=False)


def run(model, prompts, kv_connector=None, **kw):
    with LLM(model, kv_connector=kv_connector, **{**KW, **kw}) as llm:
        outs = llm.generate(prompts, SP)
        llm.check_integrity()
        return [o.token_ids for o in outs], outs, llm.stats()


def block_names(client) -> list[bytes]:
    return sorted(n for n in client.scan_iter(match="shoal:{*", count=1000))


def aside_names(client) -> list[bytes]:
    return sorted(client.scan_iter(match="shoal:quarantine:*", count=1000))


def test_restart_loads_what_the_first_run_saved(tiny_model, workload, baseline, redis_url):
    import redis
    client = redis.Redis.from_url(redis_url)
    tokens, _, first = run(tiny_model, workload, whole(redis_url))
    assert tokens == baseline
    names = block_names(client)
    assert first["blocks_saved"] == len(names) == 11  # 10 shared blocks + one tail block
    for name in names:  # one value per block: the fs pool's header and payload
        value = client.get(name)
        header = parse_header(value[:HEADER_SIZE])
        assert name.decode() == f"shoal:{{{header.key.hex()}}}"
        assert len(value) == HEADER_SIZE + header.payload_len
        assert client.ttl(name) == -1  # no TTL unless asked: capacity is the store's
    tokens, outs, second = run(tiny_model, workload, whole(redis_url))
    assert tokens == baseline
    # the first loads the shared blocks; the two arriving with it wait for that load and
    # hit it locally (the second loads its one block past them)
    assert [o.num_connector_tokens for o in outs] == [40, 4, 0]
    assert second["blocks_saved"] == 0 and second["pool_hit_blocks"] == 11
    assert second["corrupt_blocks"] == second["missing_blocks"] == second["store_errors"] == 0
    # the shorthand, with the engine's split of a hit between computing and loading
    tokens, _, _ = run(tiny_model, workload, ConnectorConfig(name="redis",
                                                            options={"url": redis_url}))
    assert tokens == baseline
    with LLM(tiny_model, kv_pool=redis_url, **KW) as llm:
        assert [o.token_ids for o in llm.generate(workload, SP)] == baseline


RUN_IN_PROCESS = """
import json, sys
from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
model, url, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = ConnectorConfig(name="redis", options={"url": url}, compute_while_loading=False)
with LLM(model, kv_connector=cfg, block_size=4, num_kv_blocks=128) as llm:
    outs = llm.generate(prompts, SamplingParams(max_tokens=10))
    print(json.dumps({"tokens": [o.token_ids for o in outs],
                      "ttft": [o.metrics.ttft_s for o in outs],
                      "loaded": [o.num_connector_tokens for o in outs], "stats": llm.stats()}))
"""


def test_two_engine_processes_share_blocks(tiny_model, workload, baseline, redis_url):
    results = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", RUN_IN_PROCESS, tiny_model, redis_url,
                            json.dumps(workload)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    producer, consumer = results
    assert producer["tokens"] == consumer["tokens"] == baseline
    assert producer["stats"]["blocks_saved"] > 0 and producer["loaded"] == [0, 0, 0]
    assert consumer["loaded"] == [40, 4, 0]  # the second process's prefix is a pool hit
    assert consumer["stats"]["blocks_saved"] == 0


def _flip(value: bytes, namespace: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0x01])


def _short(value: bytes, namespace: bytes) -> bytes:
    return value[:-8]


def _long(value: bytes, namespace: bytes) -> bytes:
    return value + b"\0" * 8


def _foreign(value: bytes, namespace: bytes) -> bytes:
    """A valid block of another model under the same name."""
    h = parse_header(value[:HEADER_SIZE])
    other = bytes(b ^ 0xFF for b in h.namespace)
    return encode_header(other, h.key, h.shape, {1: __import__("torch").float32}[h.dtype_code],
                         h.payload_len, h.checksum) + value[HEADER_SIZE:]


def _garbage(value: bytes, namespace: bytes) -> bytes:
    return b"not a block"


@pytest.mark.parametrize("damage, reason", [(_flip, "checksum"), (_short, "truncated"),
                                            (_long, "length"), (_foreign, "namespace"),
                                            (_garbage, "truncated")])
def test_bad_values_are_misses_set_aside_and_recomputed(tiny_model, workload, baseline,
                                                        redis_url, damage, reason):
    import redis
    client = redis.Redis.from_url(redis_url)
    run(tiny_model, workload, whole(redis_url))
    names = block_names(client)
    for name in names:
        client.set(name, damage(client.get(name), b""))
    tokens, _, stats = run(tiny_model, workload, whole(redis_url))
    assert tokens == baseline  # never loaded as KV
    aside = aside_names(client)
    # each bad value set aside once (two requests that read it at once both count it)
    assert 1 <= stats["store_set_aside"] == len(aside) <= stats["corrupt_blocks"]
    assert all(n.decode().endswith(f":{reason}") for n in aside)
    assert all(0 < client.ttl(n) for n in aside)  # set aside for a while, then gone
    # the recomputed blocks were saved again: a third run loads them, all of them good
    tokens, outs, third = run(tiny_model, workload, whole(redis_url))
    assert tokens == baseline and outs[0].num_connector_tokens == 40
    # but one: the second request's block past the shared ones, not read in the second run
    # (the shared blocks failed, so it computed its whole prompt, and the lookup before its
    # save found the bad value there); the third run read it, found it bad, saved it again
    assert third["corrupt_blocks"] == 1
    tokens, outs, fourth = run(tiny_model, workload, whole(redis_url))
    assert tokens == baseline and fourth["corrupt_blocks"] == 0
    assert [o.num_connector_tokens for o in outs] == [40, 4, 0]


def test_store_killed_mid_load_is_a_recompute(tiny_model, workload, baseline, tmp_path):
    from tests import gated_redis_connector as gated
    server = RedisServer(tmp_path / "redis")
    try:
        run(tiny_model, workload, whole(server.url))
        gated.GATE.clear()
        gated.HELD.clear()
        cfg = ConnectorConfig(module="tests.gated_redis_connector",
                              scheduler_class="RedisPoolScheduler", worker_class="GatedRedisWorker",
                              options={"url": server.url}, compute_while_loading=False)
        result = {}
        with LLM(tiny_model, kv_connector=cfg, **KW) as llm:
            worker = threading.Thread(target=lambda: result.update(
                outs=llm.generate(workload, SP)))
            worker.start()
            assert gated.HELD.wait(60), "no load started"
            server.kill()  # the load is in flight: its round trip meets a dead store
            gated.GATE.set()
            worker.join(120)
            assert not worker.is_alive(), "generate hung"
            stats = llm.stats()
            llm.check_integrity()
        assert [o.token_ids for o in result["outs"]] == baseline
        assert all(o.finish_reason != "error" for o in result["outs"])
        assert stats["missing_blocks"] > 0 and stats["store_errors"] > 0
    finally:
        gated.GATE.set()
        server.kill()


def test_store_killed_mid_save_is_counted(tiny_model, workload, baseline, tmp_path):
    server = RedisServer(tmp_path / "redis")
    try:
        with LLM(tiny_model, kv_connector=whole(server.url), **KW) as llm:
            server.client().client_pause(120_000, all=False)  # writes wait; lookups answer
            outs = llm.generate(workload, SP)
            server.kill()  # the saves' SETs are waiting in the paused server
            # the engine is idle once every save is reported (here: failed)
            assert llm._driver.wait_idle(60), "the saves were never reported"
            stats = llm.stats()
        assert [o.token_ids for o in outs] == baseline
        assert stats["save_failures"] > 0 and stats["blocks_saved"] == 0
    finally:
        server.kill()


def test_store_down_is_misses_then_used_again_when_back(tiny_model, workload, baseline,
                                                        tmp_path, caplog):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    require_redis()
    with LLM(tiny_model, kv_connector=whole(url, timeout_s=0.5), **KW) as llm:  # no server
        assert "cannot be reached" in caplog.text
        assert [o.token_ids for o in llm.generate(workload, SP)] == baseline
        down = llm.stats()
        assert down["store_errors"] > 0 and down["blocks_saved"] == 0
        server = RedisServer(tmp_path / "redis", port=port)
        try:
            # the store is retried once its backoff (at most 5 s) has passed
            deadline = time.monotonic() + 60
            seed = 100
            while llm.stats()["blocks_saved"] == 0 and time.monotonic() < deadline:
                llm.generate(random_prompts(512, [12], seed=seed), SamplingParams(max_tokens=1))
                seed += 1
            assert llm.stats()["blocks_saved"] > 0
        finally:
            server.kill()


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_a_full_store_refuses_or_evicts_and_outputs_stay_right(tiny_model, workload,
                                                               baseline, tmp_path, policy):
    server = RedisServer(tmp_path / "redis", "--maxmemory-policy", policy)
    try:
        client = server.client()
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory", used + 16_000)  # a few blocks of 3 KiB
        tokens, _, first = run(tiny_model, workload, whole(server.url))
        assert tokens == baseline
        if policy == "noeviction":
            assert first["store_refused_writes"] > 0 and first["save_failures"] > 0
        tokens, _, _ = run(tiny_model, workload, whole(server.url))
        assert tokens == baseline
    finally:
        server.kill()


def test_password_from_url_or_env_and_a_wrong_one_fails_bring_up(tiny_model, workload,
                                                                  baseline, tmp_path,
                                                                  monkeypatch):
    server = RedisServer(tmp_path / "redis", "--requirepass", "s3cret")
    try:
        port = server.port
        monkeypatch.delenv("SHOAL_REDIS_PASSWORD", raising=False)
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0"):
            with pytest.raises(ValueError, match="refused the credentials") as e:
                LLM(tiny_model, kv_pool=url, **KW)
            assert "wrong" not in str(e.value)  # a password is never echoed
        tokens, _, stats = run(tiny_model, workload, whole(f"redis://:s3cret@127.0.0.1:{port}/0"))
        assert tokens == baseline and stats["blocks_saved"] > 0
        monkeypatch.setenv("SHOAL_REDIS_PASSWORD", "s3cret")
        tokens, outs, _ = run(tiny_model, workload, whole(f"redis://127.0.0.1:{port}/0"))
        assert tokens == baseline and outs[0].num_connector_tokens == 40
    finally:
        server.kill()


def test_ttl_is_set_at_save_and_refreshed_by_a_load(tiny_model, workload, baseline, redis_url):
    import redis
    client = redis.Redis.from_url(redis_url)
    run(tiny_model, workload, whole(redis_url, ttl_seconds=1000))
    names = block_names(client)
    assert names and all(0 < client.ttl(n) <= 1000 for n in names)
    for n in names:
        client.expire(n, 500)
    tokens, outs, _ = run(tiny_model, workload, whole(redis_url, ttl_seconds=1000))
    assert tokens == baseline and outs[0].num_connector_tokens == 40
    assert max(client.ttl(n) for n in names) > 500  # the loaded ones got their TTL back


@pytest.mark.parametrize("options", [{"load_mode": "sync"},
                                     {"io_threads": 1, "max_read_gbps": 1.0},
                                     {"host_tier_bytes": 1 << 20}])
def test_the_options_every_store_takes(tiny_model, workload, baseline, redis_url, options):
    """The shared options work on the redis pool as on fs: sync loads, one I/O thread with
    capped reads, and a host tier on a CPU (blocks move through its pages, and a second
    load of the same blocks in one engine comes from the tier)."""
    run(tiny_model, workload, whole(redis_url, **options))
    with LLM(tiny_model, kv_connector=whole(redis_url, **options), enable_prefix_caching=False,
             **KW) as llm:  # no local prefix cache: the second round loads again
        for _ in range(2):
            outs = llm.generate(workload, SP)
            assert [o.token_ids for o in outs] == baseline
            assert [o.num_connector_tokens for o in outs] == [40, 44, 40]
        stats = llm.stats()
    assert stats["corrupt_blocks"] == stats["missing_blocks"] == 0
    if "host_tier_bytes" in options:
        assert stats["host_tier_hit_blocks"] > 0


def test_bad_redis_options_fail_at_bring_up_naming_the_option(tiny_model, redis_url):
    cases = {
        "url": {},
        "key_prefix": {"url": redis_url, "key_prefix": "a{b}"},
        "ttl_seconds": {"url": redis_url, "ttl_seconds": 0},
        "timeout_s": {"url": redis_url, "timeout_s": float("inf")},
        "tls_verify": {"url": redis_url, "tls_verify": False},  # not a rediss:// url
        "cluster": {"url": redis_url, "cluster": "yes"},
        "database": {"url": "redis://127.0.0.1:1,127.0.0.1:2/3"},  # a cluster has only db 0
        "unknown options": {"url": redis_url, "root": "/tmp"},
        "io_threads": {"url": redis_url, "io_threads": 0},
    }
    for field, options in cases.items():
        with pytest.raises(ValueError, match=field):
            LLM(tiny_model, kv_connector=ConnectorConfig(name="redis", options=options), **KW)
    with pytest.raises(ValueError, match="redis:// or rediss://"):
        LLM(tiny_model, kv_connector=ConnectorConfig(name="redis", options={"url": "http://x"}),
            **KW)


def test_key_prefix_keeps_pools_apart(tiny_model, workload, baseline, redis_url):
    run(tiny_model, workload, whole(redis_url, key_prefix="a:"))
    tokens, outs, _ = run(tiny_model, workload, whole(redis_url, key_prefix="b:"))
    assert tokens == baseline and outs[0].num_connector_tokens == 0
    tokens, outs, _ = run(tiny_model, workload, whole(redis_url, key_prefix="a:"))
    assert tokens == baseline and outs[0].num_connector_tokens == 40


def test_pool_tools_on_a_redis_pool(tiny_model, workload, redis_url):
    import redis
    client = redis.Redis.from_url(redis_url)
    run(tiny_model, workload, whole(redis_url))

    def shoal(*args):
        r = subprocess.run([sys.executable, "-m", "shoal", "pool", *args, redis_url, "--json"],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, json.loads(r.stdout)
    code, stats = shoal("stats")
    assert code == 0 and stats["num_blocks"] == 11 and stats["num_bytes"] > 11 * HEADER_SIZE
    code, report = shoal("verify")
    assert code == 0 and report["ok_blocks"] == 11
    names = block_names(client)
    client.set(names[0], _flip(client.get(names[0]), b""))
    big = parse_header(client.get(names[1])[:HEADER_SIZE])  # a header claiming 1 TiB
    client.set(names[1], encode_header(big.namespace, big.key, big.shape,
                                       __import__("torch").float32, 1 << 40, big.checksum))
    client.set("shoal:something-else", b"x")
    code, report = shoal("verify")
    assert code == 1 and report["ok_blocks"] == 9
    assert sorted(c["reason"] for c in report["corrupt"]) == ["checksum", "length"]
    assert report["skipped"] == [{"entry": "shoal:something-else", "reason": "not a block name"}]
    assert len(aside_names(client)) == 2
    code, result = shoal("gc", "--max-bytes", str(4 * len(client.get(names[2]))))
    assert code == 0 and result["removed_quarantined"] == 2 and result["num_blocks"] <= 4
    assert result["trimmed_blocks"] == 9 - result["num_blocks"]


def test_cli_refuses_a_bad_redis_pool_before_loading_weights(tiny_model, tmp_path):
    """(`shoal generate --kv-pool redis://...` on a real model: tests/test_cli.py.)"""
    server = RedisServer(tmp_path / "redis", "--requirepass", "s3cret")
    try:
        for url, needle in (("redis://127.0.0.1:1/0?x=1", "query options"),
                            (f"redis://:nope@127.0.0.1:{server.port}/0", "refused the credentials")):
            r = subprocess.run([sys.executable, "-m", "shoal", "generate", "--model", tiny_model,
                                "--kv-pool", url, "--prompt", "hi"],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and needle in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and "nope" not in r.stderr
    finally:
        server.kill()


def test_adp_owners_share_one_redis(tiny_model, redis_url):
    shared = random_prompts(512, [40], seed=7)[0]
    prompts = [shared + t for t in random_prompts(512, [5, 30, 6, 55], seed=8)]
    with LLM(tiny_model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    runs = [run(tiny_model, prompts, whole(redis_url), dp_size=2) for _ in range(2)]
    (produced, _, p_stats), (consumed, outs, c_stats) = runs
    assert produced == consumed == expected
    assert p_stats["blocks_saved"] > 0 and c_stats["blocks_saved"] == 0
    # each owner loads the shared blocks once; its later requests hit them locally
    assert all(o.num_connector_tokens + o.num_local_prefix_tokens >= 40 for o in outs)
    assert all(s["connector_tokens_loaded"] > 0 for s in c_stats["per_rank"])  # both owners
    rates = [s["load_tokens_per_s"] for s in c_stats["per_rank"]]  # a rate is a mean, not a sum
    assert all(rates) and c_stats["load_tokens_per_s"] == pytest.approx(sum(rates) / 2)


@pytest.mark.extended  # TP shards in one pool: test_tp_pool (fs); redis under ADP by default
def test_tp_shards_share_one_redis(tiny_models, redis_url):
    import redis
    model = str(tiny_models["mha_untied"])  # 4 KV heads: 2 per shard
    shared = random_prompts(512, [40], seed=7)[0]
    prompts = [shared + t for t in random_prompts(512, [3, 9, 17], seed=8)]
    with LLM(model, **KW) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    produced, _, p_stats = run(model, prompts, whole(redis_url), tp_size=2)
    consumed, outs, c_stats = run(model, prompts, whole(redis_url), tp_size=2)
    assert produced == consumed == expected
    assert all(o.num_connector_tokens >= 40 for o in outs)
    client = redis.Redis.from_url(redis_url)
    assert len(block_names(client)) == p_stats["blocks_saved"]  # each rank saved its shard
    assert {s["blocks_loaded"] for s in c_stats["per_rank"]} == {c_stats["blocks_loaded"] // 2}


def test_redis_cluster_of_three_nodes(tiny_model, workload, baseline, tmp_path):
    binary = require_redis()
    import shutil
    cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed (it creates the cluster)")
    nodes = []
    try:
        assert binary
        for i in range(3):
            nodes.append(RedisServer(tmp_path / f"n{i}", "--cluster-enabled", "yes",
                                     "--cluster-config-file", "nodes.conf",
                                     port=free_port(cluster_bus=True)))
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        for n in nodes:  # each node says when it sees the whole cluster
            n.wait_for_log(b"Cluster state changed: ok", 30)
        assert all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes)
        url = ",".join(f"redis://127.0.0.1:{n.port}" for n in nodes)
        tokens, _, first = run(tiny_model, workload, whole(url))
        assert tokens == baseline and first["blocks_saved"] == 11
        assert sum(n.client().dbsize() for n in nodes) == 11
        names = [k for n in nodes for k in n.client().scan_iter(match="shoal:{*")]
        owner = {k: n for n in nodes for k in n.client().scan_iter(match="shoal:{*")}
        for k in names:  # damage one value: set aside in its own slot, recomputed
            c = owner[k].client()
            c.set(k, _flip(c.get(k), b""))
            break
        tokens, outs, second = run(tiny_model, workload, whole(url))
        # set aside once; counted once per request that read it (a shared block: up to 3)
        assert tokens == baseline and 1 <= second["corrupt_blocks"] <= len(workload)
        assert second["store_set_aside"] == 1
        assert len(owner[k].client().keys("shoal:quarantine:*")) == 1  # in its own node
        tokens, outs, third = run(tiny_model, workload, whole(url))
        assert tokens == baseline and [o.num_connector_tokens for o in outs] == [40, 4, 0]
        # one seed node is enough with cluster=True: the client learns the others
        seed = f"redis://127.0.0.1:{nodes[1].port}"
        tokens, outs, _ = run(tiny_model, workload, whole(seed, cluster=True))
        assert tokens == baseline and [o.num_connector_tokens for o in outs] == [40, 4, 0]
    finally:
        for n in nodes:
            n.kill()


def test_rediss_with_a_ca_file(tiny_model, workload, baseline, tmp_path):
    import shutil
    require_redis()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (it makes the test's certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    try:
        server = RedisServer(tmp_path / "redis", "--tls-port", str(port), "--tls-cert-file",
                             str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
                             str(cert), "--tls-auth-clients", "no")
    except RuntimeError as e:
        pytest.skip(f"this redis-server does not serve TLS: {e}")
    try:
        url = f"rediss://127.0.0.1:{port}/0"
        tokens, _, first = run(tiny_model, workload, whole(url, tls_ca_file=str(cert)))
        assert tokens == baseline and first["blocks_saved"] == 11
        tokens, outs, _ = run(tiny_model, workload, whole(url, tls_verify=False))
        assert tokens == baseline and outs[0].num_connector_tokens == 40
        # a server the client cannot verify is a store it cannot use: misses, never wrong
        tokens, outs, stats = run(tiny_model, workload, whole(url, timeout_s=0.5))
        assert tokens == baseline and outs[0].num_connector_tokens == 0
    finally:
        server.kill()


def test_values_read_straight_into_memory(redis_url):
    """direct_read: a value lands in the caller's buffers; nil, a value of another length
    and an error reply each leave the pool's connections usable."""
    import redis

    from shoal.connectors.redis.direct_read import read_value_into
    client = redis.Redis.from_url(redis_url)
    value = bytes(range(256)) * 3000  # 768000 bytes: more than one socket read
    client.set("v", value)
    head, body = memoryview(bytearray(128)), memoryview(bytearray(len(value) - 128))
    for _ in range(3):  # the same connection again and again
        assert read_value_into(client, ("GET", "v"), [head, body]) == len(value)
        assert bytes(head) + bytes(body) == value
    assert read_value_into(client, ("GET", "absent"), [head, body]) is None
    client.set("short", b"abc")
    assert read_value_into(client, ("GET", "short"), [head, body]) == 3  # not read in
    client.rpush("list", b"x")
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        read_value_into(client, ("GET", "list"), [head, body])
    body[:] = b"\0" * len(body)
    assert read_value_into(client, ("GETEX", "v", "EX", 100), [head, body]) == len(value)
    assert bytes(head) + bytes(body) == value and 0 < client.ttl("v") <= 100
    assert client.get("short") == b"abc"  # the client's own commands still answer right


def test_large_blocks_load_straight_into_the_kv_cache(tiny_model, redis_url):
    """Blocks past half a pipeline (here 768 tokens of 768 bytes: 576 KiB) are read
    off the socket into their KV blocks; bad ones are still set aside."""
    import redis
    kw = dict(block_size=768, num_kv_blocks=8)
    prompts = random_prompts(512, [900, 800], seed=3)
    with LLM(tiny_model, **kw) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, SP)]
    tokens, _, first = run(tiny_model, prompts, whole(redis_url), **kw)
    assert tokens == expected and first["blocks_saved"] == 2
    tokens, outs, second = run(tiny_model, prompts, whole(redis_url), **kw)
    assert tokens == expected and [o.num_connector_tokens for o in outs] == [768, 768]
    client = redis.Redis.from_url(redis_url)
    for name in block_names(client):
        client.set(name, _flip(client.get(name), b""))
    tokens, outs, third = run(tiny_model, prompts, whole(redis_url), **kw)
    assert tokens == expected and third["corrupt_blocks"] >= 1
    assert all(n.decode().endswith(":checksum") for n in aside_names(client))
