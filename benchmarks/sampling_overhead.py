"""What random sampling costs against greedy, per batch size, side by side in one engine.

    python benchmarks/sampling_overhead.py [--batches 1 8 32 64] [--prompt-len 64]
        [--max-tokens 64] [--repeats 3] [--with-penalties]

For each batch size: B fresh random prompts, ``ignore_eos``, run with greedy, temperature
1.0, temperature 0.7 + top_p 0.9, top_k 50 (temperature 1.0) and seeded temperature 1.0
(one seed per request); settings alternate within each repeat so that drift on the box
hits them alike; the median output tok/s of the repeats is reported with its ratio to
greedy at the same batch size. ``--with-penalties`` adds a row with every penalty, min_p,
logit_bias, a multi-token bad word and logprobs=5. JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from common import markdown_table, random_prompts, write_json

from forerun import LLM, SamplingParams

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.7 + top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "top_k 50": dict(temperature=1.0, top_k=50),
    "seeded (temperature 1.0)": dict(temperature=1.0, seed=0),
}
PENALTIES: dict[str, Any] = dict(
    temperature=0.8, seed=0, presence_penalty=0.5, frequency_penalty=0.3,
    repetition_penalty=1.1, min_p=0.05, logit_bias={42: 2.0, 1000: -5.0},
    bad_words=["the cat sat"], logprobs=5)


def _params(setting: dict[str, Any], max_tokens: int, i: int) -> SamplingParams:
    kw = dict(setting, max_tokens=max_tokens, ignore_eos=True)
    if "seed" in kw:
        kw["seed"] = kw["seed"] + i
    return SamplingParams(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with-penalties", action="store_true")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    settings = dict(SETTINGS)
    if args.with_penalties:
        settings["penalties + logprobs=5"] = PENALTIES
    llm = LLM(model=args.model, max_num_seqs=max(args.batches),
              async_scheduling=args.async_scheduling)
    rng = random.Random(0)
    # Warm-up: kernels, lazily built per-slot sampling state, every setting once.
    for setting in settings.values():
        llm.generate(random_prompts(rng, 4, 8), [_params(setting, 4, i) for i in range(4)],
                     use_tqdm=False)
    rows = []
    for batch in args.batches:
        runs: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, setting in settings.items():
                prompts = random_prompts(rng, batch, args.prompt_len)
                params = [_params(setting, args.max_tokens, i) for i in range(batch)]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                assert n == batch * args.max_tokens
                runs[name].append(n / dt)
        greedy = statistics.median(runs["greedy"])
        for name, values in runs.items():
            tok_s = statistics.median(values)
            rows.append({"batch": batch, "sampling": name, "output tok/s": tok_s,
                         "vs greedy": tok_s / greedy, "runs": values})
            print(f"batch {batch} {name}: {tok_s:.1f} tok/s ({tok_s / greedy:.3f}x greedy)",
                  flush=True)
    llm.shutdown()
    print(markdown_table(rows, ["batch", "sampling", "output tok/s", "vs greedy"]))
    path = write_json("sampling_overhead.json", {"args": vars(args), "rows": rows}, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
