"""Is it the GIL or the cores? A decode step on the worker thread while the engine thread works.

    python benchmarks/host_contention.py [--repeats 2] [--batch 64] [--context 150]

Async scheduling runs the engine's per-step work (schedule, update, detokenise) on the
engine thread while the worker runs the forward. If that slows the forward, the cause is
either the GIL (the worker needs it between torch ops) or the CPU (the forward's OpenMP
team wants every core). A worker *process*, as vLLM's multiprocess executor has, would
remove the first and not the second. This measures one SmolLM2 decode step while the
engine thread spends ``--work-ms`` out of every ``--period-ms`` on:

- nothing (the baseline),
- pure Python, which holds the GIL,
- hashing a buffer, which releases the GIL and only occupies a core.

Rows alternate kinds, ``--repeats`` times; the median per kind is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, write_json

from forerun.config import EngineConfig
from forerun.engine.builder import resolve_model_info, shared_model
from forerun.worker.executor import run_on_worker_thread, worker_thread

# PagedDriver is test code (tests/paged_driver.py), not part of the installed package; a
# script run as `python benchmarks/host_contention.py` has only benchmarks/ on its path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.paged_driver import PagedDriver  # noqa: E402

_BLOB = bytes(1 << 18)


def _python_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _gil_free_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.sha256(_BLOB).digest()  # hashlib drops the GIL for buffers this large


WORK = {"none": None, "python (holds the GIL)": _python_work,
        "hashing (GIL released)": _gil_free_work}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per row")
    ap.add_argument("--work-ms", type=float, default=1.0)
    ap.add_argument("--period-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    info = resolve_model_info(EngineConfig(model=None))
    blocks_per_seq = (args.context + args.steps + 1) // 16 + 2

    def setup() -> PagedDriver:
        # A fresh cache and context for every row, so that every row times the same context.
        model = shared_model(info, torch.bfloat16, torch.device("cpu"))
        driver = PagedDriver(model, num_blocks=args.batch * blocks_per_seq, block_size=16)
        for i in range(args.batch):
            driver.step([(i, list(range(100, 100 + args.context)))])
        driver.step([(i, [5]) for i in range(args.batch)])  # warm
        return driver

    def timed_steps(driver: PagedDriver) -> float:
        batch = [(i, [5]) for i in range(args.batch)]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            driver.step(batch)
        return (time.perf_counter() - t0) / args.steps * 1e3

    results: dict[str, list[float]] = {k: [] for k in WORK}
    for _ in range(args.repeats):
        for kind, work in WORK.items():
            driver = run_on_worker_thread(setup)  # all torch work on the one worker thread
            future = worker_thread().submit(timed_steps, driver)
            while not future.done():
                if work is not None:
                    work(args.work_ms / 1e3)
                time.sleep((args.period_ms - args.work_ms) / 1e3)
            results[kind].append(future.result())
    base = statistics.median(results["none"])
    rows: list[dict[str, Any]] = [
        {"engine thread": kind, "ms per decode step": statistics.median(v),
         "vs none": statistics.median(v) / base, "runs": " / ".join(f"{x:.1f}" for x in v)}
        for kind, v in results.items()]
    print(f"decode step, {args.batch} sequences at ~{args.context} context; engine thread "
          f"busy {args.work_ms:g} ms of every {args.period_ms:g} ms")
    print(markdown_table(rows, ["engine thread", "ms per decode step", "vs none", "runs"]))
    path = write_json("host_contention.json", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
