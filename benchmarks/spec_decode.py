"""Speculative decoding against plain decoding, same prompts, side by side in one process.

    python benchmarks/spec_decode.py [--method ngram] [--k 4] [--repeats 2]

Greedy, at concurrency 1 and 8, with and without drafting, async scheduling on and off, on:

* **repetition**: chat requests that ask the model to copy or lightly edit a passage they
  contain, and multi-turn follow-ups that quote the model's earlier answer back to it;
* **random**: random token-id prompts (128 in, 128 out, ignore_eos), where a drafter finds
  little.

Reports output tok/s, the speed-up over the same engine without drafts, the mean accepted
length (tokens per verifying step: 1 + accepted / drafts), the acceptance rate, and whether
the tokens equal those of plain decoding. Engines alternate within each repeat, so machine
noise hits all alike; the median of the repeats is shown.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from common import markdown_table, random_prompts, write_json

from forerun import LLM, SamplingParams

PASSAGES = [
    "It is a truth universally acknowledged, that a single man in possession of a good "
    "fortune, must be in want of a wife. However little known the feelings or views of such "
    "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
    "minds of the surrounding families, that he is considered the rightful property of some "
    "one or other of their daughters.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no "
    "money in my purse, and nothing particular to interest me on shore, I thought I would "
    "sail about a little and see the watery part of the world. It is a way I have of driving "
    "off the spleen and regulating the circulation.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n"
    "        result *= i\n    return result\n",
    "The mitochondria is the powerhouse of the cell. It produces energy in the form of ATP "
    "through cellular respiration. Cells that need a lot of energy, such as muscle cells, "
    "contain many mitochondria. Mitochondria have their own DNA, inherited from the mother.",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Rewrite the following text, changing nothing except fixing any typos:\n\n{p}",
]


def repetition_workload(llm: LLM) -> tuple[list[Any], int]:
    """Chat prompts (token ids) that copy, edit, or quote back an earlier answer."""
    tok = llm.get_tokenizer()
    convs = []
    for i, p in enumerate(PASSAGES):
        convs.append([{"role": "user", "content": ASKS[i % 2].format(p=p)}])
        # A follow-up that quotes "the model's" earlier answer (the passage) back.
        convs.append([
            {"role": "user", "content": "Tell me a short passage."},
            {"role": "assistant", "content": p},
            {"role": "user", "content": "Say your previous answer again, exactly."}])
    prompts = [{"prompt_token_ids": tok(tok.apply_chat_template(
        c, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids}
        for c in convs]
    return prompts, 160


def run_once(llm: LLM, prompts: list[Any], params: SamplingParams, c: int) -> dict[str, Any]:
    s0 = llm.stats().scheduler
    t0 = time.perf_counter()
    outs = []
    # Concurrency c: batches of c requests (the engine's max_num_seqs is c too).
    for i in range(0, len(prompts), c):
        outs += llm.generate(prompts[i: i + c], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s1 = llm.stats().scheduler
    drafts = s1.spec_num_drafts - s0.spec_num_drafts
    draft_tokens = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tok_s": n_out / wall, "output_tokens": n_out,
            "mean_accepted_len": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--random-prompts", type=int, default=8)
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="speculative_config.disable_by_batch_size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k}
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    rows = []
    for c in args.concurrency:
        engines = {(drafts, mode): LLM(
            model=args.model, dtype=args.dtype, async_scheduling=mode, max_num_seqs=c,
            kv_cache_memory_bytes=512 << 20, max_model_len=2048,
            speculative_config=spec if drafts else None)
            for drafts in (False, True) for mode in ("off", "on")}
        rep_prompts, rep_len = repetition_workload(next(iter(engines.values())))
        workloads = {
            "repetition": (rep_prompts, SamplingParams(max_tokens=rep_len, temperature=0.0)),
            "random": (random_prompts(random.Random(c), max(args.random_prompts, c), 128),
                       SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)),
        }
        for llm in engines.values():  # warm-up: kernels, caches, allocator
            llm.generate(random_prompts(random.Random(1), c, 16),
                         SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        for name, (prompts, params) in workloads.items():
            runs: dict[tuple[bool, str], list[dict[str, Any]]] = {k: [] for k in engines}
            for _ in range(args.repeats):
                for key, llm in engines.items():
                    runs[key].append(run_once(llm, prompts, params, c))
            med = {k: {m: statistics.median(r[m] for r in rs)
                       for m in ("output_tok_s", "mean_accepted_len", "acceptance_rate")}
                   for k, rs in runs.items()}
            plain_tokens = runs[(False, "off")][0]["tokens"]
            for (drafts, mode), m in med.items():
                base = med[(False, mode)]["output_tok_s"]
                rows.append({
                    "workload": name, "c": c, "async": mode,
                    "spec": f"{args.method} k={args.k}" if drafts else "off",
                    **m, "vs_no_spec": m["output_tok_s"] / base,
                    "async/sync": m["output_tok_s"] / med[(drafts, "off")]["output_tok_s"],
                    "same_tokens": runs[(drafts, mode)][0]["tokens"] == plain_tokens,
                    "output_tokens": runs[(drafts, mode)][0]["output_tokens"]})
        for llm in engines.values():
            llm.shutdown()
    cols = ["workload", "c", "async", "spec", "output_tok_s", "vs_no_spec", "async/sync",
            "mean_accepted_len", "acceptance_rate", "same_tokens", "output_tokens"]
    print(markdown_table(rows, cols))
    path = write_json(f"spec_decode_{args.method}.json", {"args": vars(args), "rows": rows},
                      args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
