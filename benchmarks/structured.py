"""Throughput with 0%, 50% and 100% of requests under a JSON schema, async on and off.

Grammar requests cannot sample ahead: their step's sampling waits for the previous step's
tokens (the forward still overlaps). This shows what that costs. Every cell runs the same
prompts, greedy, with ``max_tokens`` as the cap; grammar requests may end earlier (when
their JSON is complete), so output tok/s counts the tokens actually generated. Sync and
async generate identical tokens, so the two columns of one row compare like with like.
Runs are interleaved (one of each cell per repeat) and the median is reported.

    python benchmarks/structured.py                         # 32 prompts, 64 tokens
    python benchmarks/structured.py --num-prompts 64 --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from forerun import LLM, SamplingParams, StructuredOutputsParams

RESULTS = Path(__file__).resolve().parent / "results" / "structured.json"
FRACTIONS = (0.0, 0.5, 1.0)
MODES = ("off", "on")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
    },
    "required": ["name", "age", "hobbies", "address"],
}
TOPICS = ["a pirate", "a chef", "a pilot", "a teacher", "a robot", "a farmer", "a poet",
          "a doctor"]


def make_batch(n: int, fraction: float, max_tokens: int) -> tuple[list[str], list[SamplingParams]]:
    """Every k-th request gets the schema, spread evenly through the batch."""
    prompts, params = [], []
    n_grammar = round(n * fraction)
    for i in range(n):
        prompts.append(f"Describe {TOPICS[i % len(TOPICS)]} number {i} as JSON:")
        use = n_grammar > 0 and (i * n_grammar) // n != ((i + 1) * n_grammar) // n
        so = StructuredOutputsParams(json=SCHEMA) if use else None
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                     structured_outputs=so))
    return prompts, params


def run_once(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict[str, Any]:
    before = llm.stats().num_deferred_samplings
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": n_tokens,
        "output_tok_s": n_tokens / wall,
        "deferred_samplings": stats.num_deferred_samplings - before,
        "device_busy_fraction": stats.device_busy_fraction,
        "finish_error": sum(o.outputs[0].finish_reason == "error" for o in outs),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=str(RESULTS), help="where to write the results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    llms = {m: LLM(dtype=args.dtype, device=args.device, async_scheduling=m,
                   max_model_len=1024) for m in MODES}
    # Warm-up: the model, the tokenizer info for grammars, and xgrammar's compile cache.
    for llm in llms.values():
        llm.generate(*make_batch(4, 0.5, 8), use_tqdm=False)

    runs: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for frac in FRACTIONS:
            batch = make_batch(args.num_prompts, frac, args.max_tokens)
            for mode in MODES:
                runs.setdefault((frac, mode), []).append(run_once(llms[mode], *batch))

    rows = []
    for frac in FRACTIONS:
        row: dict[str, Any] = {"grammar_fraction": frac}
        for mode in MODES:
            rs = runs[(frac, mode)]
            row[f"async_{mode}"] = {
                "output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "output_tokens": rs[0]["output_tokens"],
                "deferred_samplings": rs[0]["deferred_samplings"],
                "device_busy_fraction": statistics.median(r["device_busy_fraction"] for r in rs),
                "finish_error": rs[0]["finish_error"],
            }
        row["same_tokens"] = runs[(frac, "off")][0]["tokens"] == runs[(frac, "on")][0]["tokens"]
        row["async_speedup"] = (row["async_on"]["output_tok_s"]
                                / row["async_off"]["output_tok_s"])
        rows.append(row)

    print(f"\n{args.num_prompts} prompts, max_tokens={args.max_tokens}, {args.dtype}, "
          f"median of {args.repeats}")
    print(f"{'grammar':>8} | {'sync tok/s':>10} | {'async tok/s':>11} | {'speedup':>7} | "
          f"{'tokens':>6} | {'deferred':>8} | {'busy sync/async':>15} | same")
    for r in rows:
        off, on = r["async_off"], r["async_on"]
        print(f"{r['grammar_fraction']:>7.0%} | {off['output_tok_s']:>10.1f} | "
              f"{on['output_tok_s']:>11.1f} | {r['async_speedup']:>6.2f}x | "
              f"{off['output_tokens']:>6} | {on['deferred_samplings']:>8} | "
              f"{off['device_busy_fraction']:>7.2f}/{on['device_busy_fraction']:<7.2f} | "
              f"{r['same_tokens']}")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "structured",
        "config": vars(args),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "rows": rows,
    }, indent=2))
    print(f"wrote {out}")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
