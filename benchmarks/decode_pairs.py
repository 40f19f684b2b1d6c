"""forerun and llama.cpp on the same GGUF, timed in alternation: paired ratios on a drifting VM.

benchmarks/scale.py times each engine once per file, minutes apart. On a shared 2-core VM
the memory rate drifts by 20-50% within minutes (the streaming read measured 15 GB/s in one
scale.py run and 22 GB/s twenty minutes later), so a ratio of two numbers taken minutes
apart is mostly the drift. Here forerun stays loaded (in this process, both cores) and each
pair is one forerun measurement and one ``llama-bench -t 2 -r 1`` run right after it (in
alternating order, ABBA, so that a steady drift cancels); the ratio is taken per pair, and
the table gives the median pair ratio with its range, and the range of the streaming read
(``torch.sum`` of 512 MiB in huge pages, the lower of a read just before and just after
forerun's decode measurement): on a VM whose memory switches between a fast and a slow
phase, a pair's decode ratio follows the phase it was taken in. The bytes a decode step
reads (scale.py's ``gguf_step_bytes``) over each engine's decode time give the rate each
decode read at, which says the phase of the decode itself (the two reads around it can
miss a switch).

Per pair, with the prompt and decode lengths of scale.py:
- **prompt**: forerun ``512 / wall`` of one 512-token prompt with one output token;
  llama.cpp ``pp512``.
- **decode**: forerun ``(wall(128 in, 128 out) - wall(128 in, 1 out)) / 127``; llama.cpp
  ``tg128`` (from an empty context, so its attention reads less cache than forerun's).
- with ``--depth N``, decode only, after N tokens of context: forerun the time from the first
  to the last of 128 output tokens of one request with an N-token prompt (its
  ``RequestOutput.metrics``) over 127; llama.cpp ``tg128 @ dN`` (``llama-bench -p 0 -d N``).
  At a long context the attention's reads of the KV cache join the weights': the read rates
  then count the cache's bytes too (2 bytes a value, the middle of the decode's context).

    python benchmarks/decode_pairs.py --llama-cpp-dir LLAMA_CPP_TREE \\
        /tmp/scale/1b/1b-Q4_0.gguf /tmp/scale/1b/1b-Q4_K_M.gguf --pairs 6

forerun runs each file with ``quantization="gguf"`` (the file's own blocks, as llama.cpp).
Every timed section checks that no other process is busy (machine_load.py); the JSON keeps
what it saw.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, random_prompts, write_json
from machine_load import check_quiet
from scale import gguf_kv_bytes_per_position, gguf_step_bytes

VOCAB = 49152
COLUMNS = ["file", "pairs", "forerun prompt tok/s", "llama.cpp prompt tok/s", "prompt ratio",
           "forerun ms/token", "llama.cpp ms/token", "decode ratio", "read GB/s",
           "decode GB/s forerun / llama.cpp"]
READ_BYTES = 512 << 20


def llama_bench_once(llama_dir: Path, gguf: Path, prompt_len: int, decode_len: int,
                     threads: int, depth: int = 0) -> dict[str, float]:
    """One ``llama-bench -r 1`` run: ``pp{prompt_len}`` and ``tg{decode_len}`` tok/s; with a
    depth, ``tg{decode_len} @ d{depth}`` alone."""
    cmd = [str(llama_dir / "build" / "bin" / "llama-bench"), "-m", str(gguf),
           "-t", str(threads), "-p", str(0 if depth else prompt_len), "-n", str(decode_len),
           "-r", "1", "-o", "json"] + (["-d", str(depth)] if depth else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out: dict[str, float] = {}
    for e in json.loads(proc.stdout):
        out["prompt_tok_s" if e["n_prompt"] > 0 else "decode_tok_s"] = e["avg_ts"]
    return out


class ForerunTimer:
    """One loaded forerun engine and the two measurements a pair takes from it."""

    def __init__(self, gguf: Path, prompt_len: int, decode_len: int, seed: int,
                 depth: int = 0) -> None:
        from forerun import LLM, SamplingParams

        self.sampling = SamplingParams
        self.prompt_len, self.decode_len, self.depth = prompt_len, decode_len, depth
        self.rng = random.Random(seed)
        self.llm = LLM(str(gguf), quantization="gguf", max_num_seqs=4,
                       max_model_len=max(prompt_len, 2 * decode_len, depth + decode_len) + 64,
                       seed=seed)
        self.wall(prompt_len, 1)  # warm-up: kernels, allocator, the prompt shape
        self.wall(decode_len, 8)
        # The memory's rate beside each decode measurement: on a shared VM it can switch
        # between phases (e.g. 60 and 35 GB/s) within a second, which moves decode with it.
        from forerun.model import huge_pages

        self.read_buf = huge_pages.empty_bytes(READ_BYTES).view(torch.float32)
        self.read_buf.fill_(1.0)

    def read_gb_s(self) -> float:
        """Best of three streaming reads (``torch.sum``, huge pages) of READ_BYTES, GB/s."""
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            self.read_buf.sum()
            best = min(best, time.perf_counter() - t0)
        return READ_BYTES / best / 1e9

    def wall(self, in_len: int, out_len: int) -> float:
        return self.generate(in_len, out_len)[0]

    def generate(self, in_len: int, out_len: int) -> tuple[float, Any]:
        """The wall time of one request, and its RequestOutput."""
        sp = self.sampling(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        prompt = random_prompts(self.rng, 1, in_len, VOCAB)
        t0 = time.perf_counter()
        outs = self.llm.generate(prompt, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        if len(outs[0].outputs[0].token_ids) != out_len:
            raise RuntimeError("the engine stopped early under ignore_eos")
        return elapsed, outs[0]

    def measure(self) -> dict[str, float]:
        if self.depth:
            return self.measure_at_depth()
        prompt = self.prompt_len / self.wall(self.prompt_len, 1)
        read_before = self.read_gb_s()
        one = self.wall(self.decode_len, 1)
        full = self.wall(self.decode_len, self.decode_len)
        return {"prompt_tok_s": prompt,
                "decode_ms_per_token": 1e3 * (full - one) / (self.decode_len - 1),
                "read_gb_s": min(read_before, self.read_gb_s())}

    def measure_at_depth(self) -> dict[str, float]:
        """Decode after ``depth`` tokens of context: first to last output token over the
        tokens between (a prefill's time, seconds at a long context, is not in it)."""
        read_before = self.read_gb_s()
        _, out = self.generate(self.depth, self.decode_len)
        m = out.metrics
        return {"decode_ms_per_token": 1e3 * (m.last_token_time - m.first_token_time)
                / (self.decode_len - 1), "read_gb_s": min(read_before, self.read_gb_s())}

    def close(self) -> None:
        self.llm.shutdown()


def run_file(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    timer = ForerunTimer(gguf, args.prompt_len, args.decode_len, args.seed, args.depth)
    pairs: list[dict[str, Any]] = []
    try:
        for p in range(args.pairs):
            load = check_quiet(f"{gguf.name} pair {p}")
            order = ("forerun", "llama.cpp") if p % 4 in (0, 3) else ("llama.cpp", "forerun")
            got: dict[str, dict[str, float]] = {}
            for engine in order:
                got[engine] = (timer.measure() if engine == "forerun" else llama_bench_once(
                    args.llama_cpp_dir, gguf, args.prompt_len, args.decode_len, args.threads,
                    args.depth))
            llama_ms = 1e3 / got["llama.cpp"]["decode_tok_s"]
            pair = {"order": order, "load": load, "forerun": got["forerun"],
                    "llama.cpp": got["llama.cpp"],
                    "decode_ratio": llama_ms / got["forerun"]["decode_ms_per_token"]}
            prompt = ""
            if not args.depth:
                pair["prompt_ratio"] = (got["forerun"]["prompt_tok_s"]
                                        / got["llama.cpp"]["prompt_tok_s"])
                prompt = (f"prompt {got['forerun']['prompt_tok_s']:.1f} / "
                          f"{got['llama.cpp']['prompt_tok_s']:.1f} tok/s, ")
            print(f"{gguf.name} pair {p}: {prompt}decode "
                  f"{got['forerun']['decode_ms_per_token']:.1f} / {llama_ms:.1f} ms/token"
                  f"{f' at depth {args.depth}' if args.depth else ''}, "
                  f"read {got['forerun']['read_gb_s']:.1f} GB/s",
                  file=sys.stderr, flush=True)
            pairs.append(pair)
    finally:
        timer.close()
    # At a depth a step also reads the KV cache: on average depth + decode_len / 2 positions.
    kv = (gguf_kv_bytes_per_position(gguf) * (args.depth + args.decode_len // 2)
          if args.depth else 0)
    return {"file": str(gguf), "step_bytes": gguf_step_bytes(gguf) + kv, "kv_bytes": kv,
            "pairs": pairs}


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    pairs = result["pairs"]

    def rate_span(tok_s: list[float]) -> str:
        """The decode's read rate (step bytes x tokens/s, GB/s) over the pairs, low-high."""
        rates = [result["step_bytes"] * t / 1e9 for t in tok_s]
        return f"{min(rates):.0f}-{max(rates):.0f}"

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    def span(key: str) -> str:
        xs = [p[key] for p in pairs]
        return f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    def prompt_med(engine: str) -> str:
        if "prompt_tok_s" not in pairs[0][engine]:
            return "-"  # --depth: decode only
        return f"{med([p[engine]['prompt_tok_s'] for p in pairs]):.1f}"

    return {"file": Path(result["file"]).name, "pairs": len(pairs),
            "forerun prompt tok/s": prompt_med("forerun"),
            "llama.cpp prompt tok/s": prompt_med("llama.cpp"),
            "prompt ratio": span("prompt_ratio") if "prompt_ratio" in pairs[0] else "-",
            "forerun ms/token":
                f"{med([p['forerun']['decode_ms_per_token'] for p in pairs]):.1f}",
            "llama.cpp ms/token":
                f"{med([1e3 / p['llama.cpp']['decode_tok_s'] for p in pairs]):.1f}",
            "decode ratio": span("decode_ratio"),
            "read GB/s": "{:.0f}-{:.0f}".format(
                min(p["forerun"]["read_gb_s"] for p in pairs),
                max(p["forerun"]["read_gb_s"] for p in pairs)),
            "decode GB/s forerun / llama.cpp": "{} / {}".format(
                rate_span([1e3 / p["forerun"]["decode_ms_per_token"] for p in pairs]),
                rate_span([p["llama.cpp"]["decode_tok_s"] for p in pairs]))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files")
    ap.add_argument("--llama-cpp-dir", type=Path, required=True,
                    help="llama.cpp tree with build/bin/llama-bench")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--depth", type=int, default=0,
                    help="decode only, after this many tokens of context (llama-bench -d)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (default results/decode_pairs.json)")
    args = ap.parse_args(argv)
    if args.decode_len < 2:
        ap.error("--decode-len must be at least 2")
    start = check_quiet("start of the run", own_work=False)
    results = [run_file(f, args) for f in args.files]
    rows = [summary_row(r) for r in results]
    print(markdown_table(rows, COLUMNS))
    print("\nratios: forerun / llama.cpp per pair (> 1: forerun faster), median (range)")
    loud = [p["load"] for r in results for p in r["pairs"] if not p["load"]["quiet"]]
    if loud:
        print(f"WARNING: {len(loud)} pairs started on a busy machine; do not trust them")
    if not start["quiet"]:
        print("WARNING: the load average was high at the start (see start_load in the JSON)")
    path = write_json("decode_pairs", {"args": {k: str(v) for k, v in vars(args).items()},
                                       "start_load": start, "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
