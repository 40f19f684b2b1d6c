"""Scheduler CPU time per step with the fake worker: one KV cache group, or a hybrid one.

    python benchmarks/scheduler_step.py [--depth 1 2] [--requests 64] [--repeats 8]
        [--window 0]

64 requests of 200 prompt tokens and 256 outputs, block size 16, through the real
``Scheduler`` (depth 1) or ``AsyncScheduler`` (depth 2+) with tests.fake_executor; times
``schedule`` + ``update_from_output`` in process CPU time (robust to a shared core) and
prints the best of the repeats in microseconds per step. ``--window W`` uses a hybrid
spec of 2 full + 2 sliding layers with window W.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forerun.core.kv_cache_spec import group_layers  # noqa: E402
from tests.harness import Harness, make_request  # noqa: E402


def us_per_step(depth: int, num_requests: int, window: int) -> float:
    groups = group_layers([None, window, None, window]) if window else None
    h = Harness(async_scheduling=depth > 1, depth=depth, num_blocks=4096, block_size=16,
                max_num_batched_tokens=2048, max_num_seqs=64, check=False,
                kv_cache_groups=groups)
    spent = [0.0]
    schedule, update = h._orig_schedule, h._orig_update

    def timed_schedule():  # type: ignore[no-untyped-def]
        t = time.process_time()
        out = schedule()
        spent[0] += time.process_time() - t
        return out

    def timed_update(so, out):  # type: ignore[no-untyped-def]
        t = time.process_time()
        res = update(so, out)
        spent[0] += time.process_time() - t
        return res

    h._orig_schedule, h._orig_update = timed_schedule, timed_update
    for i in range(num_requests):
        h.add(make_request(f"r{i}", [1000 * i + j for j in range(200)], 256, 16))
    steps = h.run_until_idle()
    return spent[0] / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--window", type=int, default=0)
    args = ap.parse_args()
    for depth in args.depth:
        best = min(us_per_step(depth, args.requests, args.window) for _ in range(args.repeats))
        print(f"depth {depth}: {best:.0f} us per step (schedule + update_from_output)")


if __name__ == "__main__":
    main()
