"""Benchmarks behind `shoal bench ...`: ratios against a baseline measured in the same run."""

from __future__ import annotations

import argparse

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]  # (shoal.config.DTYPES; no torch here)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_parser(b: argparse.ArgumentParser) -> None:
    """`shoal bench`'s subcommands and their options."""
    bsub = b.add_subparsers(dest="bench", required=True)
    def model_bench(name: str, help_text: str, **ints: int) -> None:
        p = bsub.add_parser(name, help=help_text)
        p.add_argument("--model", default="smollm2",
                       help="preset, path, or random:<shape>[@<layers>] (smollm2-135m, llama-1b, "
                       "llama-8b, qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite)")
        p.add_argument("--device", default="cpu")
        for flag, default in ints.items():
            p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=default)
        return p

    t = model_bench("throughput", "tokens/s vs transformers generate, and prefix-hit TTFT",
                    num_prompts=16, max_tokens=128, prompt_len=0, rounds=3)
    t.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    t.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no captured graphs (decode steps, short prefill chunks)")
    pf = model_bench("prefill", "prefill tokens/s and MFU: the model's FLOPs against a "
                     "matmul's rate measured in the same run", num_prompts=8, prompt_len=4096,
                     rounds=3)
    pf.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    pf.add_argument("--max-num-tokens", type=_positive,
                    help="tokens per step, so the prefill's chunk (default: 16384 on a GPU, "
                    "2048 on a CPU)")
    pf.add_argument("--enforce-eager", action="store_true",
                    help="CUDA: no captured graphs (short prefill chunks)")
    tt = model_bench("ttft", "TTFT of a long prefix from the pool (loaded whole; computed "
                     "from the front while the back loads) vs recomputed (--dp 2: two owners "
                     "sharing the pool; --tp 3: every engine a TP fleet)",
                     prefix_tokens=2048, rounds=2, dp=1, tp=1)
    tt.add_argument("--block-size", type=_positive, default=16,
                    help="tokens per KV block, and so per pool file (default 16)")
    tt.add_argument("--pool-read-gbps", type=float, metavar="GBPS",
                    help="cap the pool's file reads at this rate (the fs connector's "
                    "max_read_gbps: a slow or shared store)")
    tt.add_argument("--pool", metavar="URL", help="run on this redis:// pool (under a key "
                    "prefix of its own, deleted afterwards; default: a temporary directory)")
    tt.add_argument("--skip-load-only", action="store_true",
                    help="no load-only engine (with a dead-slow store it would take ages): the "
                    "first round's engine meets the store with no load rate known")
    tt.add_argument("--source", choices=["files", "tier"], default="files",
                    help="where the hit comes from: files (page cache; default) or the host "
                    "tier (the engine computed and saved the prompt just before, under a "
                    "cache salt of its own)")
    ad = model_bench("adp", "dp N against dp 1 (control vs forward time per step, "
                     "throughput) or against tp N (KV capacity and decode throughput in the "
                     "same KV memory)", num_prompts=16, max_tokens=64, size=2)
    ad.add_argument("--against", choices=["dp1", "tp"], default="dp1",
                    help="the baseline: one rank (dp1; default), or tp N with the same KV "
                    "memory per rank (tp)")
    ad.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV memory per rank")
    st = model_bench("structured", "decode tokens/s with every request under a grammar vs "
                     "free, in the same run", num_prompts=16, max_tokens=64, rounds=3)
    st.add_argument("--grammar", choices=["regex", "json"], default="regex",
                    help="the constraint: a permissive regex, or a JSON array of strings")
    sb = bsub.add_parser("serve", help="shared-prefix workload against `shoal serve`: pool "
                         "off / on / warm restart, and the library's TPOT")
    sb.add_argument("--model", default="smollm2")
    sb.add_argument("--device", default="cpu")
    sb.add_argument("--url", help="a running server to load instead (one run, no restarts)")
    sb.add_argument("--served-model-name", default="shoal-bench")
    for flag, default in (("clients", 8), ("docs", 2), ("doc-tokens", 512), ("questions", 8),
                          ("chats", 2), ("turns", 3), ("max-tokens", 16), ("dp", 1),
                          ("num-kv-blocks", 1024)):
        sb.add_argument(f"--{flag}", type=int, default=default)
    sb.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                    help="the servers run their engine in a process of its own (shoal serve "
                    "--engine-process) or not; default: as shoal serve (on for a CUDA device); "
                    "the library's runs keep it in theirs")
    io = bsub.add_parser("pool-io", help="pool save/load GB/s vs raw file writes/reads (or "
                         "raw pipelined SET/GET with --pool redis://...)")
    io.add_argument("--pool", metavar="URL", help="measure the redis connector on this "
                    "redis:// store instead of the fs pool in a temporary directory")
    io.add_argument("--num-blocks", type=int, default=256)
    io.add_argument("--threads", type=int, help="I/O threads (default: the fs connector's, "
                    "4 on a CPU; with --device cuda, 4 where the fs pool's read processes read "
                    "the files (8 CPUs or more), else 8; at most the usable CPUs)")
    io.add_argument("--device", default="cpu", help="cpu, or cuda: GPU blocks of Llama-3.2-1B's "
                    "shape, through the host tier")
    io.add_argument("--rounds", type=int, default=3)


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from shoal.bench.throughput import run_throughput
        return run_throughput(args.model, args.num_prompts, args.max_tokens, args.device,
                              args.rounds, args.prompt_len, args.dtype, args.enforce_eager)
    if args.bench == "prefill":
        from shoal.bench.prefill import run_prefill
        return run_prefill(args.model, args.num_prompts, args.prompt_len, args.device,
                           args.rounds, args.dtype, args.max_num_tokens, args.enforce_eager)
    if args.bench == "ttft":
        from shoal.bench.ttft import run_ttft, run_ttft_dp
        if args.dp > 1:
            given = [flag for flag, on in (("--tp", args.tp != 1), ("--pool", args.pool),
                                           ("--pool-read-gbps", args.pool_read_gbps is not None),
                                           ("--skip-load-only", args.skip_load_only),
                                           ("--source", args.source != "files")) if on]
            if given:
                raise ValueError(f"bench ttft --dp runs two fleets on a pool directory of its "
                                 f"own, without {', '.join(given)}")
            return run_ttft_dp(args.model, args.prefix_tokens, args.dp, args.device,
                               args.block_size)
        return run_ttft(args.model, args.prefix_tokens, args.rounds, args.device, args.tp,
                        args.pool_read_gbps, args.source, args.pool, args.skip_load_only,
                        args.block_size)
    if args.bench == "pool-io":
        from shoal.connectors.fs.connector import default_read_processes
        from shoal.connectors.store.base import default_io_threads
        on_gpu = args.device.startswith("cuda")
        threads = args.threads or default_io_threads(  # (the redis pool has no read processes)
            on_gpu, args.pool is None and default_read_processes(args.device) > 0)
        if args.pool is not None:
            from shoal.bench.pool_io_redis import run_pool_io_redis
            return run_pool_io_redis(args.pool, args.num_blocks, threads, args.rounds,
                                     args.device)
        from shoal.bench.pool_io import run_pool_io
        return run_pool_io(args.num_blocks, threads, args.rounds, args.device)
    if args.bench == "adp":
        from shoal.bench.adp import run_adp
        return run_adp(args.model, args.num_prompts, args.max_tokens, args.device, args.size,
                       args.against, args.kv_cache_gb)
    if args.bench == "structured":
        from shoal.bench.structured import run_structured
        return run_structured(args.model, args.num_prompts, args.max_tokens, args.device,
                              args.rounds, args.grammar)
    if args.bench == "serve":
        from shoal.bench.serve import run_serve_bench
        return run_serve_bench(args)
    raise ValueError(f"unknown benchmark {args.bench!r}")
