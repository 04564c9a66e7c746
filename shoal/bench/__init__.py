"""Benchmarks behind `shoal bench ...`: ratios against a baseline measured in the same run."""

from __future__ import annotations

import argparse


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "throughput":
        from shoal.bench.throughput import run_throughput
        return run_throughput(args.model, args.num_prompts, args.max_tokens, args.device)
    raise ValueError(f"unknown benchmark {args.bench!r}")
