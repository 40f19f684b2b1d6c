"""A GGUF file's linears through forerun's GGUF matmul, per row count: GOP/s and GB/s.

Every ``blk.*`` weight of each file that forerun runs in tiles (Q4_0, Q4_1, Q8_0, MXFP4,
Q4_K, Q5_K, Q6_K; ``--type`` keeps one ggml type) is regrouped as forerun loads it
(``forerun/model/quant/gguf_blocks.py``) and multiplied, one call per weight as a step
makes them, by ``m`` bfloat16 activation rows for each ``--rows``. The time of one pass over
all of them (median of ``--repeats``) gives GOP/s (2 m n k per weight) and the weights' GB/s
(their bytes once per pass: at one row, the rate a decode step streams them at).

``--csrc DIR`` adds builds of other source trees (a copy of ``forerun/model/csrc`` with a
change), timed in alternation with the installed kernels in the same process, so that a
kernel change is measured against the code before it on a VM whose speed drifts:

    python benchmarks/gguf_linears.py /tmp/scale/1b/1b-Q6_K.gguf --rows 1 32 512 \\
        --csrc /tmp/before/csrc

Prints a table and writes results/gguf_linears.json.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from common import markdown_table, write_json
from machine_load import check_quiet

from forerun.model import cpu_kernels
from forerun.model.quant.gguf_blocks import TILED_TYPES, repack_tiles


def build(csrc: Path, out_dir: Path) -> ctypes.CDLL:
    """The GGUF matmul of the source tree ``csrc`` alone, built as the kernel library is."""
    tag = f"-{len(list(out_dir.glob('*.so')))}"
    lib = cpu_kernels.build_library([csrc / name for name in cpu_kernels.GGUF_SOURCES],
                                    out_dir / f"gguf{tag}.so", suffix=tag)
    cpu_kernels.bind_gguf_kernels(lib)
    return lib


def load_linears(path: Path, only_type: str | None
                 ) -> list[tuple[cpu_kernels.QWeightDesc, int, int, torch.Tensor]]:
    """(descriptor, n, k, tiles) of each tiled ``blk.*`` weight of the file."""
    out = []
    for t in gguf.GGUFReader(path).tensors:
        qtype = int(t.tensor_type)
        if (not t.name.startswith("blk.") or qtype not in TILED_TYPES
                or (only_type and t.tensor_type.name != only_type)):
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        raw = torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(n, -1)
        tiles = repack_tiles(qtype, raw, k)
        desc = cpu_kernels.QWeightDesc()
        desc.nparts, desc.type[0], desc.rows[0] = 1, qtype, n
        desc.data[0] = tiles.data_ptr()
        out.append((desc, n, k, tiles))
    return out


def time_pass(lib: ctypes.CDLL, linears: list, xs: dict[int, torch.Tensor],
              outs: dict[int, torch.Tensor], m: int) -> float:
    fn = lib.gguf_matmul_bf16
    t0 = time.perf_counter()
    for desc, n, k, _ in linears:
        rc = fn(xs[k].data_ptr(), ctypes.addressof(desc), None, outs[n].data_ptr(), m, n, k)
        if rc != 0:
            raise RuntimeError(f"GGUF matmul failed ({rc})")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--type", default=None, help="only weights of this ggml type (Q6_K, ...)")
    ap.add_argument("--csrc", type=Path, action="append", default=[],
                    help="another source tree of forerun/model/csrc to time alongside")
    ap.add_argument("--out", default=None, help="JSON results (default results/gguf_linears.json)")
    args = ap.parse_args()
    if not cpu_kernels.supports(torch.bfloat16, torch.device("cpu")):
        raise SystemExit("forerun's CPU kernels are not built here (no C compiler?)")
    libs: dict[str, ctypes.CDLL] = {"installed": cpu_kernels.kernel_library()}
    tmp = tempfile.TemporaryDirectory()
    for csrc in args.csrc:
        libs[str(csrc)] = build(csrc, Path(tmp.name))
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    data: dict[str, Any] = {"start_load": check_quiet("gguf_linears", own_work=False),
                            "rows": rows}
    for path in args.files:
        linears = load_linears(path, args.type)
        if not linears:
            print(f"{path.name}: no tiled weights{' of type ' + args.type if args.type else ''}")
            continue
        nbytes = sum(t.numel() for *_, t in linears)
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {x[2] for x in linears}}
            outs = {n: torch.empty(m, n, dtype=torch.bfloat16) for n in {x[1] for x in linears}}
            ops = sum(2.0 * m * n * k for _, n, k, _ in linears)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for lib in libs.values():  # warm: scratch buffers, pages
                time_pass(lib, linears, xs, outs, m)
            for r in range(args.repeats):  # alternating, the order reversed every other pass
                for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                    times[name].append(time_pass(libs[name], linears, xs, outs, m))
            base = statistics.median(times["installed"])
            for name, ts in times.items():
                t = statistics.median(ts)
                rows.append({"file": path.name, "type": args.type or "all", "build": name,
                             "rows": m, "ms": t * 1e3, "GOP/s": ops / t / 1e9,
                             "weight GB/s": nbytes / t / 1e9, "vs installed": base / t})
    data["end_load"] = check_quiet("gguf_linears")
    print(markdown_table(rows, ["file", "type", "build", "rows", "ms", "GOP/s", "weight GB/s",
                                "vs installed"]))
    print(f"wrote {write_json('gguf_linears.json', data, args.out)}")


if __name__ == "__main__":
    main()
