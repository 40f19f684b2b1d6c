"""One stream, greedy: forerun (async on and off) against the memory-bandwidth floor and
llama.cpp, on the default model in bf16.

    python benchmarks/single_stream.py                                  # 1 x 128 -> 128, 3 repeats
    python benchmarks/single_stream.py --llama-bench /tmp/llama.cpp-build/bin/llama-bench \\
        --bf16-gguf /tmp/smollm2-bf16.gguf
    python benchmarks/single_stream.py --llama-cpp DIR --hf-dir HF_DIR  # build + convert there
    python benchmarks/single_stream.py --repeats 1 --output-len 16      # smoke test
    python benchmarks/single_stream.py --quantization gguf \
        --llama-bench /tmp/llama.cpp-build/bin/llama-bench             # the Q4_1 blocks

forerun: one engine at a time (``max_num_seqs=4``), one untimed warm-up, then per repeat two
``generate`` calls on fresh random prompts (so no prefix-cache hits): one with a single
output token, whose wall time is the TTFT (prefill plus the engine's per-call overhead), and
one with ``--output-len`` tokens (``ignore_eos``). Decode ms/token is
``(wall(N) - wall(1)) / (N - 1)``, which cancels the prefill and the per-call overhead;
e2e tok/s is ``N / wall(N)``. Medians over ``--repeats``.

Bandwidth floor: a decode step must read every linear weight once (q/k/v, o, gate/up, down
in every layer) and the vocabulary projection (the tied embedding matrix); norms (a few KB)
and the KV cache (small at this length) are left out. Those bytes over the faster of two
streaming-read rates, each measured over a buffer of at least 4x the weight bytes so it
cannot sit in the (very large) L3: torch ``.sum()`` on 2 threads and forerun's own
``small_matmul`` kernel (one bf16 row against a tall weight), best of 3 each, each in
ordinary 4 KiB pages and in transparent huge pages (forerun's packed weights live in huge
pages, which read faster; the floor takes the fastest of the four rates).

``--quantization gguf`` (or ``int8``) runs forerun with that ``quantization=``; with gguf the
floor counts the GGUF blocks a step reads (the Q4_1 layers and the Q8_0 tied head).

llama.cpp: ``llama-bench -t 2 -p 128 -n 128 --repack 0`` on a bf16 GGUF (when one is given
or converted) and on the shipped Q4_1 GGUF (see peer_llama_cpp.py for why ``--repack 0``). Its decode test starts from an
empty context, forerun's after the prompt; at 128 tokens that is a small difference.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import markdown_table, random_prompts, write_json
from peer_llama_cpp import build_llama_cpp, convert_bf16, llama_bench, llama_source

from forerun import LLM, SamplingParams

MODES = ("on", "off")
COLUMNS = ["engine", "decode ms/token", "decode tok/s", "e2e tok/s", "prefill/TTFT",
           "vs floor", "vs llama.cpp bf16"]


# --- forerun ----------------------------------------------------------------------------
def run_forerun(mode: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    llm = LLM(dtype="bfloat16", max_num_seqs=4, async_scheduling=mode, seed=args.seed,
              quantization=args.quantization)
    try:
        def wall(n_out: int) -> tuple[float, Any]:
            sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
            prompt = random_prompts(rng, 1, args.input_len)
            t0 = time.perf_counter()
            out = llm.generate(prompt, sp, use_tqdm=False)[0]
            elapsed = time.perf_counter() - t0
            assert len(out.outputs[0].token_ids) == n_out
            return elapsed, out

        wall(args.output_len)  # warm-up: kernels, allocator, caches
        ttft, full, metric_ttft = [], [], []
        for _ in range(args.repeats):
            ttft.append(wall(1)[0])
            elapsed, out = wall(args.output_len)
            full.append(elapsed)
            m = out.metrics
            if m and m.first_token_time:
                metric_ttft.append(m.first_token_time - m.arrival_time)
        effective = llm.stats().async_scheduling
    finally:
        llm.shutdown()
    n = args.output_len
    decode_ms = [1e3 * (f - t) / (n - 1) for f, t in zip(full, ttft, strict=True)]
    label = f"forerun async={mode}" + (f" {args.quantization}" if args.quantization else "")
    return {"engine": label, "async_scheduling": effective,
            "decode_ms_per_token": statistics.median(decode_ms),
            "decode_tok_s": 1e3 / statistics.median(decode_ms),
            "e2e_tok_s": statistics.median(n / f for f in full),
            "ttft_ms": 1e3 * statistics.median(ttft),
            "engine_ttft_ms": 1e3 * statistics.median(metric_ttft) if metric_ttft else None,
            "decode_ms_all": decode_ms, "wall_1_s": ttft, "wall_n_s": full}


# --- bandwidth floor --------------------------------------------------------------------
def decode_weight_bytes(quantization: str | None) -> dict[str, Any]:
    """Bytes of the weights one decode step streams, from the model as forerun loads it."""
    from forerun.config import EngineConfig
    from forerun.engine.builder import resolve_model_info, shared_model

    info = resolve_model_info(EngineConfig(model=None))
    model = shared_model(info, torch.bfloat16, torch.device("cpu"), quantization)
    # What the small-batch path streams per step: its packed copy of every linear weight
    # and of the vocabulary projection (padding to 16 rows included); with gguf, the blocks.
    total = model.small_batch.streamed_bytes()
    num = 4 * len(model.model.layers) + 1
    return {"bytes": total, "num_matrices": num,
            "dtype": quantization or "bfloat16",
            "resident_weight_bytes": model.resident_weight_bytes,
            "counted": "linear weights of every layer + vocabulary projection; no norms, "
                       "no KV cache"}


def _best_rate(fn: Any, nbytes: int, tries: int = 3) -> float:
    fn()  # first touch / page faults out of the timing
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def stream_rates(weight_bytes: int, threads: int) -> dict[str, float]:
    """Streaming-read GB/s by torch ``.sum()`` and by forerun's ``small_matmul``."""
    from forerun.model import cpu_kernels, huge_pages

    nbytes = 4 * weight_bytes
    rates: dict[str, float] = {"buffer_bytes": float(nbytes)}
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for key, huge in (("torch_sum_gb_s", False), ("torch_sum_huge_pages_gb_s", True)):
            buf = (huge_pages.empty_bytes(nbytes).view(torch.float32) if huge
                   else torch.empty(nbytes // 4, dtype=torch.float32))
            buf.fill_(1.0)  # ones: no denormal slow paths
            rates[key] = _best_rate(buf.sum, buf.numel() * 4) / 1e9
            del buf
            gc.collect()
        k = 576
        if cpu_kernels.supports(torch.bfloat16, torch.device("cpu")):
            x = torch.randn(1, k).to(torch.bfloat16)
            # In ordinary pages and in huge pages (which forerun's packed weights use): the
            # floor takes the faster, so that huge pages cannot flatter forerun's ratio.
            for key, huge in (("small_matmul_gb_s", False),
                              ("small_matmul_huge_pages_gb_s", True)):
                w = cpu_kernels.pack_small_matmul_weight(
                    torch.ones(nbytes // (2 * k), k, dtype=torch.bfloat16))
                if huge:
                    w.data = huge_pages.arena_copy([w.data])[0]
                rates[key] = _best_rate(
                    lambda w=w: cpu_kernels.small_matmul(x, w, None), w.data.numel() * 2) / 1e9
                del w
                gc.collect()
    finally:
        torch.set_num_threads(prev)
    return rates


# --- llama.cpp --------------------------------------------------------------------------
def run_llama_cpp(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.llama_bench:
        binary = Path(args.llama_bench)
    elif args.llama_cpp:
        binary = build_llama_cpp(Path(args.llama_cpp))
    else:
        return []
    if args.bf16_gguf:
        bf16 = Path(args.bf16_gguf)
    elif args.hf_dir:
        if args.llama_src:
            src = Path(args.llama_src)
        elif args.llama_cpp:
            src = llama_source(Path(args.llama_cpp))
        else:
            raise SystemExit("--hf-dir needs --llama-src or --llama-cpp (the converter)")
        out = Path(args.llama_cpp or src.parent) / "model-bf16.gguf"
        bf16 = convert_bf16(src, Path(args.hf_dir), out, args.convert_python)
    elif args.quantization:
        bf16 = None  # the quantized comparison needs only the shipped file
    else:
        raise SystemExit("the llama.cpp rows need --bf16-gguf or --hf-dir")
    from forerun.model.source import resolve_model

    q4 = resolve_model(None).gguf_path  # the GGUF shipped with the default model
    rows = []
    runs = [("llama.cpp bf16", bf16)] if bf16 is not None else []
    for label, gguf in (*runs, ("llama.cpp Q4_1", q4)):
        r = llama_bench(binary, gguf, args.threads, args.input_len, args.output_len,
                        args.llama_reps)
        rows.append({"engine": label, **r})
    return rows


def table_row(r: dict[str, Any], floor_ms: float | None, llama_bf16_tok_s: float | None,
              llama_q4_tok_s: float | None = None, quantized: bool = False
              ) -> dict[str, Any]:
    """One table line; ``vs floor`` only where the floor's weights are what is read (bf16;
    or with ``quantized``, the GGUF blocks forerun and llama.cpp Q4_1 read)."""
    row: dict[str, Any] = {"engine": r["engine"], "decode ms/token": r["decode_ms_per_token"],
                           "decode tok/s": r["decode_tok_s"]}
    if "e2e_tok_s" in r:
        row["e2e tok/s"] = r["e2e_tok_s"]
    if "ttft_ms" in r:
        row["prefill/TTFT"] = f"TTFT {r['ttft_ms']:.1f} ms"
    elif "prefill_tok_s" in r:
        row["prefill/TTFT"] = f"{r['prefill_tok_s']:,.0f} tok/s"
    reads_floor_bytes = ("bf16" not in r["engine"] if quantized
                         else "Q4" not in r["engine"])
    if floor_ms and reads_floor_bytes:
        row["vs floor"] = r["decode_ms_per_token"] / floor_ms
    if llama_bf16_tok_s:
        row["vs llama.cpp bf16"] = r["decode_tok_s"] / llama_bf16_tok_s
    if llama_q4_tok_s:
        row["vs llama.cpp Q4_1"] = r["decode_tok_s"] / llama_q4_tok_s
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="floor and llama.cpp threads")
    ap.add_argument("--skip-floor", action="store_true")
    ap.add_argument("--llama-cpp", default=None, help="dir to build llama.cpp in (if needed)")
    ap.add_argument("--llama-bench", default=None, help="existing llama-bench (wins)")
    ap.add_argument("--llama-src", default=None, help="llama.cpp tree (for the converter)")
    ap.add_argument("--bf16-gguf", default=None, help="existing bf16 GGUF of the model")
    ap.add_argument("--hf-dir", default=None, help="HF folder to convert when no --bf16-gguf")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="python with numpy, sentencepiece, torch, transformers")
    ap.add_argument("--llama-reps", type=int, default=3)
    ap.add_argument("--quantization", "-q", default=None, choices=["gguf", "int8"],
                    help="forerun's quantization= (default: the exact bf16 path)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.output_len < 2:
        ap.error("--output-len must be at least 2")

    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    for mode in MODES:
        r = run_forerun(mode, args, rng)
        print(f"{r['engine']}: {r['decode_ms_per_token']:.2f} ms/token, "
              f"TTFT {r['ttft_ms']:.1f} ms", flush=True)
        results.append(r)

    floor: dict[str, Any] | None = None
    if not args.skip_floor:
        floor = decode_weight_bytes(args.quantization)
        floor.update(stream_rates(floor["bytes"], args.threads))
        floor["rate_gb_s"] = max(v for k, v in floor.items() if k.endswith("_gb_s"))
        floor["decode_ms_per_token"] = 1e3 * floor["bytes"] / (floor["rate_gb_s"] * 1e9)
        floor["decode_tok_s"] = 1e3 / floor["decode_ms_per_token"]
        floor["engine"] = "bandwidth floor"
        print(f"floor: {floor['bytes'] / 1e6:.1f} MB at {floor['rate_gb_s']:.1f} GB/s "
              f"(best of: " + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in floor.items()
                                         if k.endswith("_gb_s") and k != "rate_gb_s")
              + ")", flush=True)

    llama = run_llama_cpp(args)
    floor_ms = floor["decode_ms_per_token"] if floor else None
    llama_bf16 = next((r["decode_tok_s"] for r in llama if r["engine"] == "llama.cpp bf16"),
                      None)
    llama_q4 = next((r["decode_tok_s"] for r in llama if r["engine"] == "llama.cpp Q4_1"),
                    None) if args.quantization else None
    rows = [table_row(r, floor_ms, llama_bf16, llama_q4, bool(args.quantization))
            for r in [*results, *([floor] if floor else []), *llama]]
    columns = [*COLUMNS, *(["vs llama.cpp Q4_1"] if llama_q4 else [])]
    print(markdown_table(rows, columns))
    notes = ["decode ms/token = (wall(N tokens) - wall(1 token)) / (N - 1), fresh prompts",
             "vs floor = decode ms/token / floor ms/token (1.0 = at the bandwidth floor)",
             "vs llama.cpp bf16 = decode tok/s / llama.cpp bf16 decode tok/s",
             "llama-bench run with --repack 0 (AMX repack of Q4_1 crashes: Illegal "
             "instruction); its decode test starts from an empty context"]
    data = {"args": vars(args), "notes": notes, "forerun": results, "floor": floor,
            "llama_cpp": llama, "table": rows}
    print(f"\nwrote {write_json('single_stream.json', data, args.json)}")


if __name__ == "__main__":
    main()
