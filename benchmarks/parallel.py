"""One model over several processes on this machine: TP, PP and DP side by side.

    python benchmarks/parallel.py                 # 64 x 128 -> 128, bf16, SmolLM2
    python benchmarks/parallel.py --num-prompts 16 --output-len 32 --rows tp1,pp2-d3

Every row serves the same workload (random prompt ids, greedy, ``ignore_eos``, fresh prompts
per run so no prefix-cache hits, one untimed warm-up) with the machine's cores split the
row's way: one process with every core (``tp1``), two tensor-parallel ranks with one core
each (``tp2``; SmolLM2's 9 heads do not split in two, so it is refused there and ``tp3``
runs three ranks on the two cores), two pipeline stages with one core each at queue depth 1, 2 (sync and async)
and 3 (``pp2-d1``, ``pp2-d2-sync``, ``pp2-d2``, ``pp2-d3``: depth pp + 1 with async is the
default), and two data-parallel engine cores with one core each behind one frontend
(``dp2``, through ``AsyncLLM``; ``dp1`` is the same frontend with one engine, its
baseline). Output tok/s is the output tokens over the wall time of the whole batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any

from common import markdown_table, random_prompts, write_json

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM

# name -> (engine kwargs, served through AsyncLLM)
ROWS: dict[str, tuple[dict[str, Any], bool]] = {
    "tp1": ({}, False),
    "tp2": ({"tensor_parallel_size": 2}, False),
    "tp3": ({"tensor_parallel_size": 3}, False),
    "pp2-d1": ({"pipeline_parallel_size": 2, "async_scheduling": "off",
                "max_concurrent_batches": 1}, False),
    "pp2-d2-sync": ({"pipeline_parallel_size": 2, "async_scheduling": "off"}, False),
    "pp2-d2": ({"pipeline_parallel_size": 2, "max_concurrent_batches": 2}, False),
    "pp2-d3": ({"pipeline_parallel_size": 2}, False),
    "dp1": ({}, True),
    "dp2": ({"data_parallel_size": 2}, True),
}


def run_offline(llm: LLM, prompts: list[Any], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


async def _served(engine: AsyncLLM, prompts: list[Any], params: SamplingParams,
                  tag: str) -> float:
    async def one(i: int, prompt: Any) -> int:
        n = 0
        async for out in engine.generate(prompt, params, f"{tag}-{i}"):
            n = len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - t0)


def measure(name: str, args: argparse.Namespace, params: SamplingParams) -> dict[str, Any]:
    kwargs, served = ROWS[name]
    base = dict(model=args.model, dtype=args.dtype, max_model_len=1024,
                kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.num_prompts)
    rng = random.Random(7)
    t0 = time.perf_counter()
    if served:
        engine = AsyncLLM(EngineConfig(**base, **kwargs))
        start_s = time.perf_counter() - t0
        try:
            loop = asyncio.new_event_loop()
            runs = [loop.run_until_complete(_served(
                engine, random_prompts(rng, args.num_prompts, args.input_len), params,
                f"r{r}")) for r in range(1 + args.repeats)]
            loop.run_until_complete(engine.shutdown_async())
            loop.close()
        finally:
            engine.shutdown()
    else:
        llm = LLM(**base, **kwargs)
        start_s = time.perf_counter() - t0
        try:
            runs = [run_offline(llm, random_prompts(rng, args.num_prompts, args.input_len),
                                params) for _ in range(1 + args.repeats)]
            stats = llm.stats()
        finally:
            llm.shutdown()
        kwargs = {**kwargs, "depth": stats.max_concurrent_batches,
                  "async": stats.async_scheduling}
    timed = sorted(runs[1:])
    return {"row": name, "output_tok_s": timed[len(timed) // 2], "start_s": start_s,
            "config": kwargs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for name in args.rows.split(","):
        try:
            row = measure(name, args, params)
        except ValueError as exc:  # a size the model cannot be split by
            print(f"{name}: refused: {exc}", flush=True)
            rows.append({"row": name, "note": f"refused: {exc}"})
            continue
        print(f"{name}: {row['output_tok_s']:.1f} tok/s", flush=True)
        rows.append(row)
    ref = {r["row"]: r["output_tok_s"] for r in rows if "output_tok_s" in r}
    for r in rows:
        base = "dp1" if r["row"].startswith("dp") else "tp1"
        if base in ref and "output_tok_s" in r:
            r[f"vs {base}"] = r["output_tok_s"] / ref[base]
    print(f"\n{args.num_prompts} x {args.input_len} -> {args.output_len}, {args.dtype}, "
          f"{os.cpu_count()} CPUs")
    print(markdown_table(rows, ["row", "output_tok_s", "vs tp1", "vs dp1", "start_s",
                                "note"]))
    path = write_json("parallel.json", {"args": vars(args), "rows": rows}, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
