"""``forerun bench serve``: load-test a running OpenAI-compatible server."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` (with its ``serve`` sub-subcommand) on argparse subparsers."""
    p = subparsers.add_parser("bench", help="benchmarks")
    sub = p.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="benchmark a running server over /v1/completions")
    from forerun.bench.serve import add_serve_bench_args

    add_serve_bench_args(s)
    s.set_defaults(func=run_bench)
    return p


def run_bench(args: argparse.Namespace) -> int:
    from forerun.bench.serve import run_serve_bench

    return run_serve_bench(args)
