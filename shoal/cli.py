"""`shoal` command line: generate, serve, demo, pool, bench.

Exit codes: 0 ok; 1 a runtime failure; 2 bad arguments or configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys

from shoal.bench import add_bench_parser

EXIT_RUNTIME_ERROR = 1
EXIT_BAD_INPUT = 2


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="preset name (smollm2), HF directory or .gguf file (default: smollm2)")
    p.add_argument("--dp", type=int, default=1, help="attention data-parallel ranks (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--kv-pool", metavar="DIR|URL", help="the persistent KV pool: a directory, "
                   "or redis://host:port/db (rediss:// for TLS; a comma-separated list for "
                   "a Redis Cluster)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests per step (default 64)")
    p.add_argument("--max-num-tokens", type=int, default=2048,
                   help="tokens per step, prefill chunks included (default 2048)")
    p.add_argument("--num-kv-blocks", type=int, help="KV blocks per rank (default: from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache memory per rank (default 1.0)")
    p.add_argument("--no-overlap", action="store_true", help="use the plain executor loop")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no captured decode or short-prefill graphs)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                   help="run the engine in a process of its own, as --dp/--tp ranks are (the "
                   "server's HTTP and detokenizing then never hold the engine's GIL; default: "
                   "on for `shoal serve` on a CUDA device, else off)")


def _engine_kwargs(args: argparse.Namespace, serving: bool = False) -> dict:
    """The engine flags as LLM's keywords; `serving`: for `shoal serve`, whose engine runs in
    a process of its own on a GPU unless --no-engine-process (`runs_engine_process`)."""
    engine_process = bool(args.engine_process)
    if serving:  # (the server's modules: only for it)
        from shoal.serving.process import runs_engine_process
        engine_process = runs_engine_process(args.engine_process, args.device)
    return dict(kv_pool=args.kv_pool, dp_size=args.dp, tp_size=args.tp,
                block_size=args.block_size, max_batch_size=args.max_batch_size,
                max_num_tokens=args.max_num_tokens, num_kv_blocks=args.num_kv_blocks,
                kv_cache_gb=args.kv_cache_gb, overlap_scheduler=not args.no_overlap,
                device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
                engine_process=engine_process)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=(
        "Shoal: a compact LLM inference engine with a persistent, shared KV pool."))
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for several)")
    g.add_argument("--prompts-file", metavar="F", help="a file with one prompt per line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--json", action="store_true",
                   help="one JSON object per request, then {\"summary\": stats}")

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    _add_engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    sv.add_argument("--served-model-name", metavar="NAME",
                    help="the model's name in the API (default: the --model value)")
    sv.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SEC",
                    help="on SIGTERM/SIGINT, how long running requests may take to finish "
                    "before they are cancelled (default 30)")
    sv.add_argument("--access-log", action="store_true", help="log every HTTP request")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N",
                    help="refuse (413) a request body larger than this, before it is parsed "
                    "(default 8 MiB)")
    sv.add_argument("--max-concurrent-requests", type=int, metavar="N",
                    help="generation requests taken at once; a request holds its place until "
                    "the engine ended every choice (default: the engine's batch, max batch size x "
                    "data-parallel ranks)")
    sv.add_argument("--max-queue", type=int, metavar="N",
                    help="requests that may wait for a place; past it the answer is 429 with "
                    "Retry-After (default: as many as may run at once)")
    sv.add_argument("--read-timeout", type=float, default=30.0, metavar="SEC",
                    help="a client that sends no byte of an unfinished request for this long "
                    "gets 408 and is disconnected (default 30; 0 = never)")
    sv.add_argument("--api-key", metavar="KEY", default=os.environ.get("SHOAL_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                    "$SHOAL_API_KEY; /health and /metrics stay open)")

    d = sub.add_parser("demo", help="the main job on the embedded default model")
    d.add_argument("--model", default="smollm2", help=argparse.SUPPRESS)
    d.add_argument("--no-overlap", action="store_true", help="use the plain executor loop")
    d.add_argument("--kv-pool", metavar="DIR", help="pool directory to use and keep "
                   "(default: a temporary one, removed afterwards)")

    pool = sub.add_parser("pool", help="inspect and maintain a KV pool (a directory or a "
                          "redis:// URL)")
    psub = pool.add_subparsers(dest="pool_command", required=True)
    ps = psub.add_parser("stats", help="size, block count, quarantined and temp files")
    pv = psub.add_parser("verify", help="check every file's header and checksum; "
                         "quarantine corrupt ones (exit 1 if any)")
    pg = psub.add_parser("gc", help="remove stale temp files; trim to --max-bytes (LRU)")
    pg.add_argument("--max-bytes", type=int, help="capacity to trim the pool to, least "
                    "recently used first (0 removes every block file)")
    for p in (ps, pv, pg):
        p.add_argument("dir", metavar="POOL", help="the pool: a directory, or redis://host:port/db "
                       "(the names under the default prefix shoal:)")
        p.add_argument("--json", action="store_true", help="print one JSON object")

    add_bench_parser(sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s [rank 0] %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            from shoal.bench.demo import run_demo
            return run_demo(args.model, overlap=not args.no_overlap, pool_dir=args.kv_pool)
        if args.command == "pool":
            return _pool(args)
        if args.command == "bench":
            from shoal.bench import run_bench
            return run_bench(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (RuntimeError, OSError) as e:  # OSError: e.g. a pool gc without permission
        print(f"shoal: error: {e}", file=sys.stderr)
        return EXIT_RUNTIME_ERROR
    except KeyboardInterrupt:
        _end_progress_bars()
        print("shoal: interrupted", file=sys.stderr)
        return 130
    return EXIT_BAD_INPUT


def _end_progress_bars() -> None:
    """Close the progress bars still drawn, so the line after them starts a line of its own
    (a Ctrl-C may land while a bar is being made, before `generate` can close it). A bar
    interrupted inside its own constructor is drawn but in no list: the line it may hold is
    blanked with a carriage return, as tqdm redraws."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return  # no bar was ever drawn
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar interrupted half made: nothing more to draw
            pass
    width = shutil.get_terminal_size().columns
    print("\r" + " " * (width - 1) + "\r", end="", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from shoal import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT or --prompts-file F")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    _check_pool(args)
    from shoal.parallel.torchrun import launched_by_torchrun
    if launched_by_torchrun():
        return _generate_under_torchrun(args, prompts, sampling)
    with LLM(args.model, **_engine_kwargs(args)) as llm:
        show_bar = len(prompts) > 1 or args.max_tokens > 64
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sampling,
                            use_tqdm=show_bar)
        else:
            outs = llm.generate(prompts, sampling, use_tqdm=show_bar)
        stats = llm.stats()
    return _print_outputs(args, outs, stats)


def _serve(args: argparse.Namespace) -> int:
    import contextlib

    from shoal import LLM
    from shoal.serving.process import listen, serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    limits = _server_limits(args)
    _check_pool(args)
    # an address in use fails before the weights load too
    with contextlib.closing(listen(args.host, args.port)) as sock:
        llm = LLM(args.model, **_engine_kwargs(args, serving=True))
        try:
            serve(llm, sock, args.served_model_name or args.model, args.shutdown_grace,
                  api_key=args.api_key or None, limits=limits, access_log=args.access_log)
        finally:
            llm.shutdown()  # drains pending saves, stops every rank
    return 0


def _server_limits(args: argparse.Namespace):
    """The serve flags' limits (ValueError naming the flag)."""
    from shoal.serving.limits import ServerLimits

    if args.read_timeout < 0:
        raise ValueError(f"--read-timeout must be >= 0 (0 = never), got {args.read_timeout}")
    try:
        return ServerLimits(max_body_bytes=args.max_body_bytes,
                            max_concurrent_requests=args.max_concurrent_requests,
                            max_queue=args.max_queue,
                            read_timeout_s=args.read_timeout or None)
    except ValueError as e:
        name = str(e).split()[0]
        raise ValueError(f"--{name.replace('_', '-').removesuffix('-s')}: {e}") from None


def _check_pool(args: argparse.Namespace) -> None:
    """A bad --kv-pool directory (or a Redis refusing the password) fails before the
    weights load."""
    if args.kv_pool is not None:
        from shoal.llm import pool_connector
        config = pool_connector(args.kv_pool)
        if config.name == "redis":
            from shoal.connectors.redis.connector import open_redis_pool
            open_redis_pool(config)[0].close()
        else:
            from shoal.connectors.fs.connector import open_pool
            open_pool(config)


def _generate_under_torchrun(args, prompts: list[str], sampling) -> int:
    from dataclasses import replace

    from shoal.config import EngineConfig
    from shoal.llm import pool_connector
    from shoal.model.loader import load_tokenizer_only
    from shoal.parallel.torchrun import run_requests
    from shoal.request import NewRequest

    if not sampling.is_greedy and sampling.seed is None:
        raise ValueError("--seed is required for sampling under torchrun (every rank must "
                         "draw the same tokens)")
    kw = _engine_kwargs(args)
    pool = kw.pop("kv_pool")
    config = EngineConfig(model=args.model, **kw,
                          kv_connector=None if pool is None else pool_connector(pool))
    tok = load_tokenizer_only(args.model)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat
           else tok.encode(p) for p in prompts]
    outs, stats = run_requests(config, [NewRequest(i, sampling, prompt=p)
                                        for i, p in zip(ids, prompts)])
    if outs is None:
        return 0  # not rank 0: rank 0 prints
    outs = [replace(o, text=tok.decode(o.token_ids)) for o in outs]
    return _print_outputs(args, outs, {**stats, "per_rank": [stats]})


def _print_outputs(args, outs, stats) -> int:
    failed = 0
    for i, out in enumerate(outs):
        failed += out.finish_reason == "error"
        if args.json:
            print(json.dumps({
                "index": i, "text": out.text, "token_ids": out.token_ids,
                "finish_reason": out.finish_reason, "error": out.error,
                "ttft_s": out.metrics.ttft_s,
                "num_local_prefix_tokens": out.num_local_prefix_tokens,
                "num_connector_tokens": out.num_connector_tokens,
                "pool_hit": None if out.pool_hit is None else dataclasses.asdict(out.pool_hit)}))
        elif out.finish_reason == "error":
            print(f"[{i}] error: {out.error}", file=sys.stderr)
        else:
            print(out.text if len(outs) == 1 else f"[{i}] {out.text}")
    if args.json:
        print(json.dumps({"summary": stats}))
    return EXIT_RUNTIME_ERROR if failed else 0


def _pool(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from shoal.connectors.fs import admin as pool_admin

    if getattr(args, "max_bytes", None) is not None and args.max_bytes < 0:
        raise ValueError(f"--max-bytes must be >= 0 (0 removes every block), got {args.max_bytes}")
    if args.dir.startswith(("redis://", "rediss://")):
        return _redis_pool(args)
    root = Path(args.dir)
    pool_admin.check_pool(root)
    if args.pool_command == "stats":
        result = asdict(pool_admin.pool_stats(root))
        text = (f"{result['num_blocks']} blocks, {result['num_bytes'] / 2**20:.1f} MiB, "
                f"{result['num_quarantined']} quarantined, {result['num_temp']} temp files, "
                f"{result['num_skipped']} skipped entries")
        code = 0
    elif args.pool_command == "verify":
        result, text = _verify_report(pool_admin.verify_pool(root))
        code = 1 if result["corrupt"] or result["skipped"] else 0
    else:
        temp = pool_admin.remove_stale_temp_files(root)
        trimmed = 0 if args.max_bytes is None else pool_admin.trim_pool(root, args.max_bytes)
        result = {"removed_temp_files": temp, "trimmed_blocks": trimmed,
                  **asdict(pool_admin.pool_stats(root))}
        text = (f"removed {temp} stale temp files, trimmed {trimmed} blocks; now "
                f"{result['num_blocks']} blocks, {result['num_bytes'] / 2**20:.1f} MiB")
        code = 0
    print(json.dumps(result) if args.json else text)
    return code


def _redis_pool(args: argparse.Namespace) -> int:
    """`shoal pool stats|verify|gc redis://...`: the same reports as for a directory."""
    from dataclasses import asdict

    import redis

    from shoal.connectors.redis import admin
    from shoal.connectors.redis.connector import open_redis_pool
    from shoal.llm import pool_connector

    store, _ = open_redis_pool(pool_connector(args.dir))
    try:
        if args.pool_command == "stats":
            result = asdict(admin.pool_stats(store))
            text = (f"{result['num_blocks']} blocks, {result['num_bytes'] / 2**20:.1f} MiB, "
                    f"{result['num_quarantined']} set aside, {result['num_skipped']} other names "
                    "under the prefix")
            code = 0
        elif args.pool_command == "verify":
            result, text = _verify_report(admin.verify_pool(store))
            code = 1 if result["corrupt"] or result["skipped"] else 0
        else:
            removed, trimmed = admin.gc_pool(store, args.max_bytes)
            result = {"removed_quarantined": removed, "trimmed_blocks": trimmed,
                      **asdict(admin.pool_stats(store))}
            text = (f"removed {removed} set-aside values, trimmed {trimmed} blocks; now "
                    f"{result['num_blocks']} blocks, {result['num_bytes'] / 2**20:.1f} MiB")
            code = 0
    except redis.exceptions.RedisError as e:
        raise ValueError(f"{store.target.display}: {type(e).__name__}: {e}") from None
    finally:
        store.close()
    print(json.dumps(result) if args.json else text)
    return code


def _verify_report(report) -> tuple[dict, str]:
    """`shoal pool verify` output: (the JSON object, the text)."""
    kept = dict(report.not_quarantined)
    result = {"ok_blocks": report.num_ok, "corrupt_blocks": len(report.corrupt),
              "corrupt": [{"file": f, "reason": r} for f, r in report.corrupt],
              "not_quarantined": [{"file": f, "error": e} for f, e in report.not_quarantined],
              "skipped": [{"entry": p, "reason": r} for p, r in report.skipped]}
    lines = [f"{report.num_ok} blocks ok, {len(report.corrupt)} corrupt "
             f"({len(report.corrupt) - len(kept)} quarantined), {len(report.skipped)} skipped"]
    lines += [f"  {f}: {r}" + (f" (not quarantined: {kept[f]})" if f in kept else "")
              for f, r in report.corrupt]
    lines += [f"  {p}: skipped ({r})" for p, r in report.skipped]
    return result, "\n".join(lines)
