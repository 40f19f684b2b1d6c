"""Async scheduling against the synchronous engine, same workloads, side by side.

    python benchmarks/async_vs_sync.py [--dtype bfloat16] [--repeats 3]

Three workloads: decode-heavy (64 x 128 random prompt tokens x 128 output tokens,
ignore_eos), mixed (varied prompt and output lengths, some greedy requests free to stop on
EOS), and small-batch (decode-heavy with 8 requests: short steps, where the per-step host
work that async hides is the largest share of a step).
Both engines live in one process and alternate runs, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from common import markdown_table, mean_tpot_ms, random_prompts, write_json

from forerun import LLM, SamplingParams
from forerun.trace import WORKER_LANE, Span


def decode_heavy(rng: random.Random, n: int, inp: int, out: int):
    return random_prompts(rng, n, inp), [
        SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)] * n


def mixed(rng: random.Random, n: int, inp: int, out: int):
    prompts, params = [], []
    for i in range(n):
        prompts += random_prompts(rng, 1, rng.randint(max(1, inp // 8), inp * 2))
        # Every third request may end on EOS; the rest run to a random length.
        params.append(SamplingParams(max_tokens=rng.randint(max(1, out // 8), out * 2),
                                     temperature=0.0, ignore_eos=i % 3 != 0))
    return prompts, params


def worker_idle_ms(spans: list[Span]) -> float:
    """Median time the worker sat idle between the end of one step and the next start."""
    steps: dict[int, list[Span]] = {}
    for s in spans:
        if s.lane == WORKER_LANE:
            steps.setdefault(s.step, []).append(s)
    ids = sorted(steps)
    gaps = [1e3 * (min(s.start for s in steps[b]) - max(s.end for s in steps[a]))
            for a, b in zip(ids, ids[1:], strict=False)]
    return statistics.median(gaps) if gaps else float("nan")


def run_once(llm: LLM, prompts, params) -> dict[str, Any]:
    before = llm.stats().scheduler.wasted_tokens
    tracer = llm.llm_engine.tracer
    tracer.enabled = True
    tracer.spans.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    return {"output_tok_s": n_out / wall, "wall_s": wall, "output_tokens": n_out,
            "mean_tpot_ms": mean_tpot_ms(outs),
            "device_busy_fraction": stats.device_busy_fraction,
            "worker_idle_ms_per_step": worker_idle_ms(tracer.spans),
            "wasted_tokens": stats.scheduler.wasted_tokens - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--small-batch", type=int, default=8,
                    help="requests in the small-batch workload")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (on a shared box, 1 avoids straggler stalls)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {mode: LLM(model=args.model, dtype=args.dtype, async_scheduling=mode,
                         kv_cache_memory_bytes=1 << 30, max_model_len=1024)
               for mode in ("off", "on")}
    rng = random.Random(0)
    for llm in engines.values():  # warm-up
        llm.generate(*decode_heavy(rng, 8, 16, 8), use_tqdm=False)
    rows = []
    for name, make, n in (("decode-heavy", decode_heavy, args.num_prompts),
                          ("mixed", mixed, args.num_prompts),
                          ("small-batch", decode_heavy, args.small_batch)):
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            seed = rng.randrange(1 << 30)
            for mode, llm in engines.items():
                # The same fresh prompts for both modes within a repeat.
                prompts, params = make(random.Random(seed), n, args.input_len,
                                       args.output_len)
                runs[mode].append(run_once(llm, prompts, params))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for m, rs in runs.items()}
        for mode in ("off", "on"):
            rows.append({"workload": name, "async": mode, **med[mode],
                         "async/sync": med["on"]["output_tok_s"] / med["off"]["output_tok_s"]
                         if mode == "on" else 1.0})
    cols = ["workload", "async", "output_tok_s", "async/sync", "mean_tpot_ms",
            "device_busy_fraction", "worker_idle_ms_per_step", "wasted_tokens", "output_tokens"]
    print(markdown_table(rows, cols))
    path = write_json("async_vs_sync.json", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
