"""``forerun bench serve`` against a real server (shared with test_server.py when both run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import MODEL, start_server

pytestmark = pytest.mark.slow


FIELDS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
          "total_input_tokens", "total_output_tokens",
          *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
            for s in ("mean", "median", "p99")))


def test_bench_serve_random(tmp_path: Path) -> None:
    server = start_server()
    server.wait_healthy()
    result_file = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "forerun.cli", "bench", "serve", "--base-url", server.base_url,
         "--model", MODEL, "--dataset", "random", "--input-len", "16", "--output-len", "8",
         "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm",
         "--save-result", "--result-file", str(result_file)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(result_file.read_text())
    for field in FIELDS:
        assert field in result, field
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 16
    assert result["total_output_tokens"] == 8 * 8
    assert result["mean_ttft_ms"] > 0 and result["mean_e2el_ms"] >= result["mean_ttft_ms"]


def test_bench_counts_failures() -> None:
    """A dead endpoint is reported as failed requests, not dropped or crashed on."""
    import asyncio

    from forerun.bench.datasets import SampleRequest
    from forerun.bench.serve import run_benchmark

    reqs = [SampleRequest([1, 2, 3], 3, 4) for _ in range(3)]
    result = asyncio.run(run_benchmark("http://127.0.0.1:9", "m", reqs, 2, float("inf"),
                                       True, disable_tqdm=True, timeout_s=5))
    assert result["failed"] == 3 and result["completed"] == 0 and result["errors"]
