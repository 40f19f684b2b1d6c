"""Throughput with every penalty and logprobs=5 on, against plain sampling, side by side.

    python benchmarks/sampling_overhead.py [--batch 32] [--prompt-len 64] [--max-tokens 64]

Same engine, same random prompts, seeded random sampling in both runs; the "full" run adds
presence/frequency/repetition penalties, min_p, a logit_bias, a multi-token bad word and
logprobs=5. Prints tokens/s of each and their ratio; JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from common import markdown_table, random_prompts, write_json

from forerun import LLM, SamplingParams


def _params(full: bool, max_tokens: int, i: int) -> SamplingParams:
    kw: dict[str, Any] = dict(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
    if full:
        kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                  min_p=0.05, logit_bias={42: 2.0, 1000: -5.0}, bad_words=["the cat sat"],
                  logprobs=5)
    return SamplingParams(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, max_num_seqs=args.batch)
    rng = random.Random(0)
    # Warm-up (allocates the lazily built per-slot sampling state too).
    llm.generate(random_prompts(rng, 4, 8), [_params(True, 4, i) for i in range(4)],
                 use_tqdm=False)
    rows = []
    for full in (False, True):
        best = 0.0
        for _ in range(args.repeats):
            prompts = random_prompts(rng, args.batch, args.prompt_len)
            params = [_params(full, args.max_tokens, i) for i in range(args.batch)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            best = max(best, n / dt)
        rows.append({"sampling": "penalties+logprobs=5" if full else "plain",
                     "output tok/s": best})
    ratio = rows[1]["output tok/s"] / rows[0]["output tok/s"]
    print(markdown_table(rows, ["sampling", "output tok/s"]))
    print(f"ratio full/plain: {ratio:.3f}")
    path = write_json("sampling_overhead.json", {"args": vars(args), "rows": rows, "ratio": ratio},
                      args.output)
    print(f"wrote {path}")
    llm.shutdown()


if __name__ == "__main__":
    main()
