"""Decode speed over a long context by KV cache dtype: auto against int8 and fp8.

    python benchmarks/kv_dtype.py                                   # 4k and 8k, batch 4
    python benchmarks/kv_dtype.py --contexts 256 --batch 1 --output-len 8 --repeats 1  # smoke

At long context a decode step's attention reads every cached key and value of its
sequences; a 1-byte cache (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2) reads a quarter of
float32's bytes, half of bfloat16's. Per context length and dtype, one engine (the default
model, ``--dtype``), one untimed warm-up, then per repeat a batch of ``--batch`` fresh random
prompts of that length (no prefix-cache hits) decoding ``--output-len`` tokens
(``ignore_eos``, greedy). Decode tok/s is ``batch * 1000 / TPOT`` with TPOT the mean time per
output token after the first (the requests' own timestamps, so the prefill is left out);
median over ``--repeats``. Also reported: the KV blocks the same memory budget holds, and
whether the greedy tokens equal the first dtype's (quantized KV may flip a near tie). One
table and a JSON file.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from typing import Any

from common import markdown_table, mean_tpot_ms, random_prompts, write_json

from forerun import LLM, SamplingParams


def run_one(kv_dtype: str, context: int, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:
    batch, out_len = args.batch, args.output_len
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2's float32 K + V: one budget for every dtype
    llm = LLM(dtype=args.dtype, kv_cache_dtype=kv_dtype, max_model_len=context + out_len + 16,
              max_num_seqs=batch, kv_cache_memory_bytes=int(
                  1.3 * per_token * batch * (context + out_len + 32)) + (64 << 20))
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed)
    llm.generate(random_prompts(rng, 1, 64), SamplingParams(max_tokens=4), use_tqdm=False)
    tpots, tokens = [], []
    for r in range(args.repeats):
        prompts = random_prompts(random.Random(seed * 1000 + r), batch, context)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tpots.append(mean_tpot_ms(outs))
        tokens.append([o.outputs[0].token_ids for o in outs])
    stats = llm.stats().kv_cache
    llm.shutdown()
    del llm
    gc.collect()
    tpot = statistics.median(tpots)
    return {"kv_cache_dtype": kv_dtype, "context": context, "batch": batch,
            "tpot_ms": tpot, "decode_tok_s": batch * 1e3 / tpot,
            "num_blocks": stats.num_blocks, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3"])
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
            print(f"context {context} {kv_dtype}: {row['decode_tok_s']:.1f} tok/s", flush=True)
    print(markdown_table(rows, ["context", "kv_cache_dtype", "batch", "tpot_ms",
                                "decode_tok_s", "speedup", "num_blocks",
                                "same_tokens_as_first"]))
    path = write_json("kv_dtype.json", {
        "args": vars(args),
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
