"""bfloat16 matmuls per shape: forerun's register-tile GEMM against oneDNN, and the ceiling.

For each linear of a model shape (Llama-3.2-1B's by default: q/k/v, o, gate/up, down, the
output head) and each row count, GFLOP/s (2 m n k / s, median of ``--repeats`` calls, the
two kernels alternating in one process) of:

- **oneDNN**: ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once at load
  (``forerun/model/packed_linear.py``: what forerun runs past the small-batch path with AMX,
  and what vLLM's CPU linears run);
- **tiles**: forerun's ``small_matmul`` on its packed copy (``csrc/small_matmul.c``: the
  small-batch path's weights, which also serve every step without AMX);
- **peak**: the AVX512-BF16 dot-product instruction (``vdpbf16ps``) alone, 24 independent
  accumulators per thread on registers, no memory: what no bf16 GEMM on this CPU exceeds.

    python benchmarks/gemm_bf16.py [--rows 32 128 512] [--repeats 7]

Prints a table and writes results/gemm_bf16.json. Needs a CPU with AVX512-BF16 (elsewhere
the tiles are not built and the script says so).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from common import markdown_table, write_json

from forerun import envs
from forerun.model import cpu_kernels
from forerun.model.packed_linear import PackedLinear

# (name, in_features k, out_features n): Llama-3.2-1B's linears, SmolLM2's vocabulary.
SHAPES = [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384),
          ("down", 8192, 2048), ("head", 2048, 49152)]

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
/* 64 * iters * 24 flop per call; a[] stays in registers (no loads in the loop). */
float bf16_peak(int64_t iters) {
    float sink = 0.f;
#pragma omp parallel reduction(+ : sink)
    {   /* everything per thread: a shared operand would be reloaded from memory */
        __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(1);
        __m512 b[24];
        for (int i = 0; i < 24; ++i) b[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
            for (int i = 0; i < 24; ++i) b[i] = _mm512_dpbf16_ps(b[i], x, y);
            __asm__ volatile("" : "+v"(x));
        }
        for (int i = 0; i < 24; ++i) sink += _mm512_reduce_add_ps(b[i]);
    }
    return sink;
}
"""


def peak_gflops(threads: int) -> float:
    """GFLOP/s of vdpbf16ps alone on ``threads`` threads (the best of three calls)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(PEAK_SOURCE)
        subprocess.run([envs.c_compiler(), "-O3", "-march=native", "-fopenmp", "-shared",
                        "-fPIC", str(src), "-o", str(lib)], check=True)
        fn = ctypes.CDLL(str(lib)).bf16_peak
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_int64]
        iters = 2_000_000
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            fn(iters)
            best = max(best, threads * iters * 24 * 64 / (time.perf_counter() - t) / 1e9)
        return best


def median_seconds(fn, repeats: int) -> float:  # noqa: ANN001 - any zero-argument call
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="JSON results (default results/gemm_bf16.json)")
    args = ap.parse_args()
    if not cpu_kernels.small_matmul_is_fast(torch.bfloat16):
        raise SystemExit("no AVX512-BF16 body of the small matmul on this CPU")
    threads = torch.get_num_threads()
    peak = peak_gflops(threads)
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        onednn, tiles = PackedLinear(w, None), cpu_kernels.pack_small_matmul_weight(w)
        del w
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).bfloat16()
            runs: dict[str, list[float]] = {"oneDNN": [], "tiles": []}
            calls = {"oneDNN": lambda x=x, w=onednn: w(x),
                     "tiles": lambda x=x, w=tiles: cpu_kernels.small_matmul(x, w, None)}
            for _ in range(2):  # alternating, so that a drift of the machine hits both
                for key, call in calls.items():
                    runs[key].append(median_seconds(call, args.repeats))
            flop = 2 * m * n * k
            row = {"linear": name, "k": k, "n": n, "rows": m,
                   **{f"{key} GFLOP/s": flop / min(v) / 1e9 for key, v in runs.items()}}
            row["tiles / oneDNN"] = row["tiles GFLOP/s"] / row["oneDNN GFLOP/s"]
            row["oneDNN / peak"] = row["oneDNN GFLOP/s"] / peak
            row["tiles / peak"] = row["tiles GFLOP/s"] / peak
            rows_out.append(row)
            print(markdown_table([row], list(row)).splitlines()[-1], flush=True)
    columns = list(rows_out[0])
    print(f"\nvdpbf16ps peak on {threads} threads: {peak:.1f} GFLOP/s\n")
    print(markdown_table(rows_out, columns))
    path = write_json("gemm_bf16.json", {"threads": threads, "peak_gflops": peak, "rows": rows_out},
                      args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
