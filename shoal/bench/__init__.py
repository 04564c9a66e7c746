"""Benchmarks behind `shoal bench ...`: ratios against a baseline measured in the same run."""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from shoal.bench.throughput import run_throughput
        return run_throughput(args.model, args.num_prompts, args.max_tokens, args.device,
                              args.rounds, args.prompt_len, args.dtype, args.enforce_eager)
    if args.bench == "ttft":
        from shoal.bench.ttft import run_ttft, run_ttft_dp
        if args.dp > 1:
            return run_ttft_dp(args.model, args.prefix_tokens, args.dp, args.device)
        return run_ttft(args.model, args.prefix_tokens, args.rounds, args.device, args.tp,
                        args.pool_read_gbps, args.source, args.pool)
    if args.bench == "pool-io":
        from shoal.connectors.store.base import default_io_threads
        threads = args.threads or default_io_threads(args.device.startswith("cuda"))
        if args.pool is not None:
            from shoal.bench.pool_io_redis import run_pool_io_redis
            return run_pool_io_redis(args.pool, args.num_blocks, threads, args.rounds,
                                     args.device)
        from shoal.bench.pool_io import run_pool_io
        return run_pool_io(args.num_blocks, threads, args.rounds, args.device)
    if args.bench == "adp":
        from shoal.bench.adp import run_adp
        return run_adp(args.model, args.num_prompts, args.max_tokens, args.device)
    if args.bench == "structured":
        from shoal.bench.structured import run_structured
        return run_structured(args.model, args.num_prompts, args.max_tokens, args.device,
                              args.rounds, args.grammar)
    if args.bench == "serve":
        from shoal.bench.serve import run_serve_bench
        return run_serve_bench(args)
    raise ValueError(f"unknown benchmark {args.bench!r}")
