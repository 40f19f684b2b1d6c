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
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


# Each test's benchmark and arguments (its --json is added).
COMMANDS: dict[str, tuple[str, ...]] = {
    "test_kv_dtype_times_decode_steps_on_the_c_stack": (
        "kv_dtype.py", "--contexts", "256", "--batch", "2", "--output-len", "6",
        "--repeats", "1"),
    "test_kv_offload_connector_rows_hit": (
        "kv_offload.py", "--tiny", "--conversations", "6", "--turns", "3"),
}


class Run:
    """``benchmarks/<script> *args --json <file>`` started now; :meth:`result` waits for it
    and reads its JSON."""

    def __init__(self, script: str, *args: str, folder: Path) -> None:
        self.json_path = folder / "result.json"
        self.out = (folder / "output").open("w+", encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *args,
                                      "--json", str(self.json_path)],
                                     stdout=self.out, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=ROOT)

    def result(self) -> dict:
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.out.seek(0)
        output = self.out.read()
        self.out.close()
        assert self.proc.returncode == 0, output
        return json.loads(self.json_path.read_text())


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[dict[str, Run]]:
    """The selected tests' benchmarks, all started together: their interpreters' imports
    and model loads overlap instead of queueing (kv_dtype's step times are only checked to
    be positive)."""
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    started = {name: Run(*cmd, folder=tmp_path_factory.mktemp("bench"))
               for name, cmd in COMMANDS.items() if name in selected}
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def test_kv_dtype_times_decode_steps_on_the_c_stack(runs: dict[str, Run],
                                                    request: pytest.FixtureRequest) -> None:
    result = runs[request.node.originalname].result()
    auto, int8 = result["rows"]
    for row in (auto, int8):
        assert row["path"] == "c-stack", row
        assert row["decode_tok_s"] > 0 and row["weight_mb_per_step"] > 100, row
    # One byte a value plus a scale per (block, head) against the model dtype's 2 or 4.
    assert int8["kv_mb_per_step"] < 0.6 * auto["kv_mb_per_step"], (auto, int8)


def test_kv_offload_connector_rows_hit(runs: dict[str, Run],
                                       request: pytest.FixtureRequest) -> None:
    result = runs[request.node.originalname].result()
    total = sum(result["prompt_lens"])
    share = {name: sum(r["cached_tokens"]) / total for name, r in result["runs"].items()}
    assert share["no connector"] < share["connector"] < share["after restart"], share
    assert share["after restart"] > 0.9, share
