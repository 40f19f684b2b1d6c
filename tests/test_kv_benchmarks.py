"""The issue-29 benchmarks at smoke size: they measure what they say they measure.

``benchmarks/kv_dtype.py`` times decode steps only (every request's prompt a prefix-cache
hit, the steps on the one-call C stack) and reports the bytes a step reads;
``benchmarks/kv_offload.py`` shows connector hits, and more after a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, json_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args,
                           "--json", str(json_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(json_path.read_text())


def test_kv_dtype_times_decode_steps_on_the_c_stack(tmp_path: Path) -> None:
    result = _run("kv_dtype.py", "--contexts", "256", "--batch", "2", "--output-len", "6",
                  "--repeats", "1", json_path=tmp_path / "kv_dtype.json")
    auto, int8 = result["rows"]
    for row in (auto, int8):
        assert row["path"] == "c-stack", row
        assert row["decode_tok_s"] > 0 and row["weight_mb_per_step"] > 100, row
    # One byte a value plus a scale per (block, head) against the model dtype's 2 or 4.
    assert int8["kv_mb_per_step"] < 0.6 * auto["kv_mb_per_step"], (auto, int8)


def test_kv_offload_connector_rows_hit(tmp_path: Path) -> None:
    result = _run("kv_offload.py", "--tiny", "--conversations", "6", "--turns", "3",
                  json_path=tmp_path / "kv_offload.json")
    total = sum(result["prompt_lens"])
    share = {name: sum(r["cached_tokens"]) / total for name, r in result["runs"].items()}
    assert share["no connector"] < share["connector"] < share["after restart"], share
    assert share["after restart"] > 0.9, share
