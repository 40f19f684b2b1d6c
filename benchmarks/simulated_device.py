"""Where async scheduling pays, without a GPU: the real engine around a simulated device.

    python benchmarks/simulated_device.py [--device h100/llama-3-8b | h100/smollm2-135m] [--repeats 3]

The forward sleeps for the roofline time of each step on the device (forerun.worker
.simulated: Llama-3-8B-shaped steps of about 5 ms on an H100 at decode) while the CPU does
everything else for real: scheduling, input preparation, the frontend's detokenising.
Decode-heavy batches (128 prompt tokens, 128 output tokens, ignore_eos) at several
concurrencies, synchronous and async engines alternating. ``device-bound tok/s`` is the
output tokens over the summed modelled device time: what an engine that never lets the
device idle would reach. ``of device-bound`` is how close each engine gets.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from common import markdown_table, random_prompts, write_json

from forerun import LLM, SamplingParams


def run_once(llm: LLM, prompts: list[Any], params: SamplingParams) -> dict[str, float]:
    runner = llm.llm_engine.executor.runner
    device_s0 = runner.simulated_device_s
    llm.llm_engine.reset_stats_window()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    llm.llm_engine.close_stats_window()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    device_s = runner.simulated_device_s - device_s0
    return {"output_tok_s": n / wall, "device_bound_tok_s": n / device_s,
            "of_device_bound": device_s / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="h100/llama-3-8b")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for c in args.concurrency:
        engines = {mode: LLM(simulated_device=args.device, async_scheduling=mode,
                             max_num_seqs=c, kv_cache_memory_bytes=4 << 30,
                             max_model_len=1024) for mode in ("off", "on")}
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        for llm in engines.values():  # warm-up
            llm.generate(random_prompts(random.Random(1), c, 16),
                         SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in engines}
        for r in range(args.repeats):
            prompts = random_prompts(random.Random(100 + r), c, args.input_len)
            for mode, llm in engines.items():
                runs[mode].append(run_once(llm, prompts, params))
        med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
               for m, rs in runs.items()}
        for mode in ("off", "on"):
            rows.append({"c": c, "async": mode, **med[mode],
                         # What the synchronous engine spends off the device per step.
                         "host share (sync)": 1 - med["off"]["of_device_bound"],
                         "async/sync": med[mode]["output_tok_s"] / med["off"]["output_tok_s"]})
        for llm in engines.values():
            llm.shutdown()
    cols = ["c", "async", "output_tok_s", "device_bound_tok_s", "of_device_bound",
            "host share (sync)", "async/sync"]
    print(f"simulated device: {args.device}")
    print(markdown_table(rows, cols))
    path = write_json("simulated_device.json", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
