"""Decode speed over a long context by KV cache dtype: auto against int8 (and fp8).

    python benchmarks/kv_dtype.py                                   # 4k and 8k, batch 4
    python benchmarks/kv_dtype.py --contexts 512 --batch 2 --output-len 8 --repeats 1  # smoke

At long context a decode step's attention reads every cached key and value of its
sequences; a 1-byte cache (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2) reads a quarter of
float32's bytes, half of bfloat16's.

What is timed is decode steps only, every sequence of the batch at the stated context. Per
context length and dtype, one engine (the default model, ``--dtype``) prefills ``--batch``
fresh random prompts of that length once (``max_tokens=1``, untimed: at 8k that is minutes
on one core, most of this script's wall time). Each repeat then sends the same prompts again
with ``--output-len`` tokens (``ignore_eos``, greedy): the prefix cache holds every full
block, so one small step recomputes the prompts' last block and yields every request's
first token together, and the rest are decode steps of the whole batch. TPOT is the mean
time per output token after the first (the requests' own timestamps); decode tok/s is
``batch * 1000 / TPOT``, the median over ``--repeats``.

(Before this, each repeat sent fresh prompts: with chunked prefill the first request
decodes while the others prefill in 2048-token chunks of several seconds each, so its
"TPOT" was mostly the others' prefill: 2 tok/s at 4k, batch 4.)

Wall time is nearly all the untimed prefill (a chunk over earlier context costs more the
longer that context is): about 45 s per engine at 4k and 140 s at 8k on one quiet core of
the 2-core CPU, so about 7 minutes for the default (auto and int8 at 4k and 8k, 3 repeats
of 32 tokens); each further dtype adds half that.

Also per row: the bytes one decode step reads (the C stack's weights plus the batch's KV
pages at the mean decode context, a quantized cache's scales included) and the GB/s that
implies; the decode path (``c-stack`` when every decode step ran the one-call small-batch
stack, small_batch.py); whether the greedy tokens equal the first dtype's (quantized KV may flip a near tie). One table and a JSON
file.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

from common import markdown_table, mean_tpot_ms, random_prompts, write_json

from forerun import LLM, SamplingParams


def step_bytes(llm: LLM, batch: int, context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step of ``batch`` sequences at ``context`` reads."""
    runner = llm.llm_engine.executor.runner
    weights = runner.model.small_batch.streamed_bytes()
    per_block = sum(t[0].numel() * t.element_size() for kv in runner.kv_caches for t in kv)
    block_size = llm.llm_engine.config.block_size
    return weights, batch * -(-context // block_size) * per_block


def run_one(kv_dtype: str, context: int, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:
    batch, out_len = args.batch, args.output_len
    # Room for the batch in any dtype (SmolLM2's float32 K + V); the engine caps the pool
    # at what max_num_seqs * max_model_len can use, so the pool does not differ by dtype.
    per_token = 2 * 30 * 3 * 64 * 4
    llm = LLM(dtype=args.dtype, kv_cache_dtype=kv_dtype, max_model_len=context + out_len + 16,
              max_num_seqs=batch, kv_cache_memory_bytes=int(
                  1.3 * per_token * batch * (context + out_len + 32)) + (64 << 20))
    stack = llm.llm_engine.executor.runner.model.small_batch
    calls = {"stack": 0}
    forward = stack.forward

    def counted(*a: Any, **kw: Any) -> Any:
        calls["stack"] += 1
        return forward(*a, **kw)

    stack.forward = counted  # type: ignore[method-assign]
    prompts = random_prompts(random.Random(seed), batch, context)
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    prefill_s = time.perf_counter() - t
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    tpots, tokens, stack_calls = [], [], []
    for _ in range(args.repeats):
        calls["stack"] = 0
        outs = llm.generate(prompts, sp, use_tqdm=False)
        stack_calls.append(calls["stack"])
        cached = min(o.num_cached_tokens for o in outs)
        if cached < context - llm.llm_engine.config.block_size:
            raise RuntimeError(f"prefix cache hit {cached} of {context}: the decode steps "
                               "would be timed with a prefill among them")
        tpots.append(mean_tpot_ms(outs))
        tokens.append([o.outputs[0].token_ids for o in outs])
    weights, kv = step_bytes(llm, batch, context + out_len // 2)
    dtype = str(llm.llm_engine.executor.runner.dtype).removeprefix("torch.")
    llm.shutdown()
    del llm
    gc.collect()
    tpot = statistics.median(tpots)
    return {"kv_cache_dtype": kv_dtype, "dtype": dtype, "context": context, "batch": batch,
            "prefill_s": prefill_s, "tpot_ms": tpot, "decode_tok_s": batch * 1e3 / tpot,
            "weight_mb_per_step": weights / 1e6, "kv_mb_per_step": kv / 1e6,
            "gb_s": (weights + kv) / tpot / 1e6,
            # The first step recomputes the prompts' tails (more than 8 tokens at batch 2+).
            "path": "c-stack" if min(stack_calls) >= out_len - 2 else "op-by-op",
            "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 8k: SmolLM2 holds 8192 positions, so 8128 prompt tokens + 32 decoded + 16 of slack.
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8128])
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="where to write (default results/kv_dtype.json)")
    args = ap.parse_args()
    rows = []
    for context in args.contexts:
        base: dict[str, Any] | None = None
        for kv_dtype in args.kv_dtypes:
            row = run_one(kv_dtype, context, args, seed=context)
            if base is None:
                base = row
            row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"]
            row["same_tokens_as_first"] = row["tokens"] == base["tokens"]
            rows.append(row)
            print(f"context {context} {kv_dtype}: {row['decode_tok_s']:.1f} tok/s "
                  f"(prefill {row['prefill_s']:.0f} s)", flush=True)
    print(markdown_table(rows, ["context", "dtype", "kv_cache_dtype", "batch", "tpot_ms",
                                "decode_tok_s", "speedup", "weight_mb_per_step",
                                "kv_mb_per_step", "gb_s", "path",
                                "same_tokens_as_first"]))
    path = write_json("kv_dtype.json", {
        "args": vars(args),
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
