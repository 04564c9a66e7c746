"""`shoal bench ttft`: TTFT of a long shared prefix in a fresh engine with the prefix in the
pool (loaded whole, or computed from the front while the back loads) vs recomputed,
measured side by side in one run."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import zlib
from typing import Callable, Iterator

import torch

from shoal import LLM, SamplingParams
from shoal.connectors import ConnectorConfig
from shoal.request import RequestOutput
from shoal.util import cdiv

ONE = SamplingParams(max_tokens=1)
CPU_TIER_BYTES = 1 << 30  # --source tier on a CPU (a GPU's default tier is larger)


def _prompt(llm: LLM, num_tokens: int, question: str = " Question: what must the tenant do?"
            ) -> list[int]:
    """`num_tokens` tokens: a shared body, then up to 16 of `question` (at most half; random
    ids, fixed by the text, for a checkpoint with no tokenizer)."""
    asked = min(16, num_tokens // 2)
    if llm.config.model.startswith("random:"):
        def ids(n: int, seed: int) -> list[int]:
            gen = torch.Generator().manual_seed(seed)
            return torch.randint(3, llm.engine.info.vocab_size, (n,), generator=gen).tolist()
        return ids(num_tokens - asked, 0) + ids(asked, zlib.crc32(question.encode()))
    text = " ".join(f"Clause {i}: the tenant keeps the harbor gate closed after dark."
                    for i in range(num_tokens // 8 + 1))
    tail = llm.tokenizer.encode(question)[:asked]
    return llm.tokenizer.encode(text)[:num_tokens - len(tail)] + tail


@contextlib.contextmanager
def bench_pool(pool: str | None, **options) -> Iterator[Callable[..., ConnectorConfig]]:
    """The pool a bench runs on, as a maker of connector configs (keyword arguments: the
    config's fields): a temporary directory (pool None, removed afterwards), or a
    redis:// URL, under a key prefix of its own (its names deleted afterwards)."""
    if pool is None:
        with tempfile.TemporaryDirectory(prefix="shoal-bench-") as root:
            yield lambda **kw: ConnectorConfig(name="fs", options={"root": root, **options}, **kw)
        return
    from shoal.connectors.redis.connector import open_redis_pool
    options = {"url": pool, "key_prefix": f"shoalbench{os.getpid()}:", **options}
    try:
        yield lambda **kw: ConnectorConfig(name="redis", options=options, **kw)
    finally:
        store, _ = open_redis_pool(ConnectorConfig(name="redis", options=options))
        names = list(store.client.scan_iter(match=f"{options['key_prefix']}*", count=1000))
        for i in range(0, len(names), 256):
            store.client.delete(*names[i:i + 256])
        store.close()


def run_ttft(model: str, prefix_tokens: int, rounds: int, device: str, tp: int = 1,
             pool_read_gbps: float | None = None, source: str = "files",
             pool: str | None = None, skip_load_only: bool = False, block_size: int = 16) -> int:
    """TTFT of one prompt whose prefix the pool holds, each way in a fresh engine per round:
    recomputed (no pool), loaded whole before computing on (`compute_while_loading=False`),
    and computed from the front while the back loads (the default); and the floor
    n / (C + L), with C and L the rates the first two imply. `pool_read_gbps` caps the
    pool's reads (a slow or shared store). `pool`: a redis:// URL to run on (default: a
    temporary directory). `source="tier"`: the hit comes from the host tier: the engine
    first computes the prompt under a cache salt of its own (a miss: it is saved through
    the tier, which keeps it), then the timed request with the same salt hits the blocks
    the tier holds (prefix caching is off, so it goes to the pool). tp > 1: every engine is
    a TP fleet. On a GPU the prompt is prefilled in one chunk, and an engine runs one
    request at a time (on one rank with CUDA graphs captured for that: the one-row decode
    step and a short chunk, such as the rest of a prompt after a hit, of up to 512 tokens).
    `skip_load_only`: no load-only engine (a dead-slow store would take ages), so the first
    round's engine meets the store with no load rate known (its first hit), and later
    rounds with what the rounds before learned; no floor then. `block_size`: tokens per KV
    block, so per pool file (a load's cost is mostly per file)."""
    kw = dict(device=device, tp_size=tp, block_size=block_size)
    if device.startswith("cuda"):
        kw.update(max_num_tokens=max(prefix_tokens, 2048), max_batch_size=1,
                  num_kv_blocks=cdiv(prefix_tokens, block_size) + 64)
    if source == "tier":
        kw.update(enable_prefix_caching=False)
    options = {} if pool_read_gbps is None else {"max_read_gbps": pool_read_gbps}
    if source == "tier" and not device.startswith("cuda"):  # a CPU's default is no tier
        options["host_tier_bytes"] = CPU_TIER_BYTES
    with bench_pool(pool, **options) as connector:
        def pool_engine(**connector_fields) -> LLM:
            return LLM(model, kv_connector=connector(**connector_fields), **kw)

        def pool_ttft(llm: LLM) -> RequestOutput:
            if source == "tier":  # computed and saved: the tier keeps what it saved
                salt = os.urandom(8).hex()
                llm.generate([prompt], ONE, cache_salt=salt)
                return llm.generate([prompt], ONE, cache_salt=salt)[0]
            return llm.generate([prompt], ONE)[0]

        with pool_engine() as llm:  # computes and saves
            prompt = _prompt(llm, prefix_tokens)
            # not a baseline: the process's first forward also pays one-time start-up
            # (library initialisation, first-touch of memory)
            first_s = llm.generate([prompt], ONE)[0].metrics.ttft_s
        runs: dict[str, list] = {"recomputed": [], "load_only": [], "compute_and_load": []}
        hits = []
        for _ in range(rounds):
            with LLM(model, **kw) as llm:  # fresh engine, no pool: recompute
                runs["recomputed"].append(llm.generate([prompt], ONE)[0].metrics.ttft_s)
            if not skip_load_only:
                with pool_engine(compute_while_loading=False) as llm:
                    out = pool_ttft(llm)
                    runs["load_only"].append(out.metrics.ttft_s)
                    tokens_loaded, bytes_loaded = (out.num_connector_tokens,
                                                   llm.stats()["bytes_loaded"])
            with pool_engine() as llm:  # the default: the front computes while the back loads
                out = pool_ttft(llm)
                runs["compute_and_load"].append(out.metrics.ttft_s)
                hits.append(out.pool_hit)
                if skip_load_only:
                    tokens_loaded, bytes_loaded = (out.num_connector_tokens,
                                                   llm.stats()["bytes_loaded"])
    if skip_load_only:
        return _report_without_load_only(model, device, prompt, rounds, pool_read_gbps, runs,
                                         hits, block_size)
    med = {k: statistics.median(v) for k, v in runs.items()}
    # C and L as the first two runs imply them (fixed costs included): both at once
    floor = med["recomputed"] * med["load_only"] / (med["recomputed"] + med["load_only"])
    last = hits[-1]
    result = {
        "bench": "ttft", "model": model, "device": device, "tp": tp, "prompt_tokens": len(prompt),
        "block_size": block_size, "rounds": rounds, "source": source,
        "pool_read_gbps": pool_read_gbps,
        "pool": "files" if pool is None else "redis",
        "tokens_loaded": tokens_loaded, "bytes_loaded": bytes_loaded,
        "ttft_recomputed_s": med["recomputed"], "ttft_load_only_s": med["load_only"],
        "ttft_pool_s": med["compute_and_load"], "ttft_floor_s": floor,
        "ratio_pool_over_recomputed": med["compute_and_load"] / med["recomputed"],
        "ratio_load_only_over_recomputed": med["load_only"] / med["recomputed"],
        "ratio_floor_over_recomputed": floor / med["recomputed"],
        "split": None if last is None else {
            "decision": last.decision, "front_tokens": last.num_front_tokens,
            "loaded_tokens": last.num_loaded_tokens,
            "prefill_tokens_per_s": round(last.prefill_tokens_per_s),
            "load_tokens_per_s": round(last.load_tokens_per_s),
            "load_latency_s": round(last.load_latency_s, 4),
            "host_tokens": last.num_host_tokens},
        "first_run_s": round(first_s, 4),
        **{f"all_{k}_s": [round(x, 4) for x in v] for k, v in runs.items()},
    }
    print(f"{len(prompt)}-token prompt, {block_size}-token blocks, fresh engines"
          f"{f' (tp={tp})' if tp > 1 else ''}, hits "
          f"from {'the host tier' if source == 'tier' else 'files' if pool is None else 'redis'}"
          f"{f', reads capped at {pool_read_gbps:g} GB/s' if pool_read_gbps else ''}, "
          f"median of {rounds} rounds")
    print(f"  TTFT recomputed                 {med['recomputed']:8.3f} s")
    print(f"  TTFT loaded whole, then computed {med['load_only']:7.3f} s  ({tokens_loaded} "
          f"tokens, {bytes_loaded / 1e9:.3f} GB)  ratio {result['ratio_load_only_over_recomputed']:.3f}")
    print(f"  TTFT computed + loaded at once  {med['compute_and_load']:8.3f} s  ratio "
          f"{result['ratio_pool_over_recomputed']:.3f}"
          + ("" if last is None else f"  ({last.decision}: {last.num_front_tokens} computed, "
             f"{last.num_loaded_tokens} loaded)"))
    print(f"  floor n / (C + L)               {floor:8.3f} s  ratio "
          f"{result['ratio_floor_over_recomputed']:.3f}")
    print(json.dumps(result))
    return 0


def _report_without_load_only(model, device, prompt, rounds, pool_read_gbps, runs, hits,
                              block_size: int) -> int:
    """Each round's compute + load against the median recompute: the first round's engine
    had no load rate (its first hit), later ones what the earlier rounds learned."""
    recomputed = statistics.median(runs["recomputed"])
    ratios = [t / recomputed for t in runs["compute_and_load"]]
    result = {"bench": "ttft", "model": model, "device": device, "prompt_tokens": len(prompt),
              "block_size": block_size, "rounds": rounds, "pool_read_gbps": pool_read_gbps,
              "load_only": "skipped",
              "ttft_recomputed_s": recomputed,
              "ttft_pool_s": [round(t, 4) for t in runs["compute_and_load"]],
              "ratio_first_hit": ratios[0], "ratio_median": statistics.median(ratios),
              "hits": [None if h is None else {"decision": h.decision,
                                               "front_tokens": h.num_front_tokens,
                                               "loaded_tokens": h.num_loaded_tokens}
                       for h in hits],
              "all_recomputed_s": [round(x, 4) for x in runs["recomputed"]]}
    print(f"{len(prompt)}-token prompt, {block_size}-token blocks, fresh engines"
          f"{f', reads capped at {pool_read_gbps:g} GB/s' if pool_read_gbps else ''}, "
          f"no load-only engine, {rounds} rounds")
    print(f"  TTFT recomputed (median)        {recomputed:8.3f} s")
    for i, (t, r, h) in enumerate(zip(runs["compute_and_load"], ratios, hits)):
        print(f"  round {i + 1}: computed + loaded    {t:8.3f} s  ratio {r:.3f}  "
              f"({'no hit' if h is None else h.decision}"
              f"{' - no load rate known yet' if i == 0 else ''})")
    print(json.dumps(result))
    return 0


def run_ttft_dp(model: str, prefix_tokens: int, dp: int, device: str, block_size: int = 16
                ) -> int:
    """Two owners sharing the pool: owner 0 of a first fleet computes and saves the prefix;
    a fresh fleet then serves the prompt and a sibling (same prefix, other question) at
    once, one per owner. The second owner's TTFT shows what owner 0's saves save it."""
    with tempfile.TemporaryDirectory(prefix="shoal-bench-ttft-dp-") as pool:
        kw = dict(kv_pool=pool, device=device, dp_size=dp, block_size=block_size)
        with LLM(model, **kw) as llm:
            prompt = _prompt(llm, prefix_tokens)
            sibling = _prompt(llm, prefix_tokens, " Question: who keeps the gate?")
            cold = llm.generate([prompt], ONE)[0]  # the router gives it to owner 0
            saved = [s["blocks_saved"] for s in llm.stats()["per_rank"]]
        with LLM(model, **kw) as llm:
            warm = llm.generate([prompt, sibling], ONE)  # one per owner
            loaded = [s["connector_tokens_loaded"] for s in llm.stats()["per_rank"]]
    result = {"bench": "ttft", "dp": dp, "model": model, "prompt_tokens": len(prompt),
              "block_size": block_size,
              "blocks_saved_per_owner_cold": saved, "tokens_loaded_per_owner_warm": loaded,
              "ttft_cold_s": cold.metrics.ttft_s,
              "ttft_warm_owner0_s": warm[0].metrics.ttft_s,
              "ttft_warm_owner1_s": warm[1].metrics.ttft_s,
              "ratio_owner1_over_cold": warm[1].metrics.ttft_s / cold.metrics.ttft_s}
    print(f"{len(prompt)}-token prompt, {block_size}-token blocks, {dp} ADP owners sharing "
          f"one pool")
    print(f"  cold (owner 0 computes, saves {saved} blocks per owner)   {cold.metrics.ttft_s:8.3f} s")
    print(f"  warm fleet, owner 0 (loads its own saves)        {warm[0].metrics.ttft_s:8.3f} s")
    print(f"  warm fleet, owner 1 (loads owner 0's saves)      {warm[1].metrics.ttft_s:8.3f} s  "
          f"ratio {result['ratio_owner1_over_cold']:.3f}; tokens loaded per owner {loaded}")
    print(json.dumps(result))
    return 0
