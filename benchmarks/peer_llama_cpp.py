"""llama.cpp as a single-stream peer: build ``llama-bench``, make a bf16 GGUF, run it.

    python benchmarks/peer_llama_cpp.py --llama-bench PATH --gguf MODEL.gguf [--threads 2]
    python benchmarks/peer_llama_cpp.py --workdir DIR [--hf-dir HF_DIR]   # build (~15 min)

The source is the llama.cpp that PyPI's ``llama-cpp-python`` source package vendors (pinned
below), so that nothing but the ordinary package registry is needed. ``--repack 0`` is always
passed: on AMX CPUs llama-bench dies with "Illegal instruction" on Q4_1 weights when it
repacks them (a llama.cpp bug), and passing it for bf16 too keeps the two rows alike.
``benchmarks/single_stream.py`` imports the functions here for its llama.cpp rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from common import markdown_table, write_json

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-server", "llama-batched-bench")


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kwargs)


def llama_source(workdir: Path) -> Path:
    """The vendored llama.cpp tree of the pinned source package, downloaded if missing."""
    unpacked = workdir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    src = unpacked / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    workdir.mkdir(parents=True, exist_ok=True)
    tarball = workdir / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not tarball.exists():
        print(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (source)", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(workdir)])
    print(f"unpacking {tarball}", flush=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(workdir, filter="data")
    return src


def build_llama_cpp(workdir: Path) -> Path:
    """``workdir/build/bin/llama-bench``, building llama.cpp there first if it is missing."""
    build = workdir / "build"
    binary = build / "bin" / "llama-bench"
    if binary.exists():
        return binary
    src = llama_source(workdir)
    print(f"building llama.cpp into {build} (about 15 minutes on 2 cores)", flush=True)
    # Native code for this CPU, like forerun's kernels (-march=native); no networking.
    _run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
          "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_SERVER=ON"])
    _run(["cmake", "--build", str(build), "-j2", "--target", *TARGETS])
    return binary


def convert_bf16(llama_src: Path, hf_dir: Path, out: Path, python: str) -> Path:
    """A bf16 GGUF of the HF folder, made by the source's ``convert_hf_to_gguf.py``.

    ``python`` needs numpy, sentencepiece, torch and transformers; the script puts the
    tree's own ``gguf-py`` on its path.
    """
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _run([python, str(llama_src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16",
          "--outfile", str(out)])
    return out


def llama_bench(binary: Path, gguf: Path, threads: int, n_prompt: int, n_gen: int,
                reps: int) -> dict[str, Any]:
    """Prefill and decode tok/s of one model from ``llama-bench -o json``."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(reps), "--repack", "0", "-o", "json"]
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    entries = json.loads(proc.stdout)
    result: dict[str, Any] = {"gguf": str(gguf), "threads": threads, "n_prompt": n_prompt,
                              "n_gen": n_gen, "reps": reps, "repack": False, "cmd": cmd}
    for e in entries:
        # llama-bench runs one test per entry: pp (n_gen == 0) or tg (n_prompt == 0).
        kind = "prefill" if e["n_prompt"] > 0 else "decode" if e["n_gen"] > 0 else None
        if kind is None:
            continue
        result[f"{kind}_tok_s"] = e["avg_ts"]
        result[f"{kind}_tok_s_std"] = e["stddev_ts"]
        result.update(model_type=e["model_type"], model_size_bytes=e["model_size"],
                      build_commit=e["build_commit"])
    if "decode_tok_s" in result:
        result["decode_ms_per_token"] = 1e3 / result["decode_tok_s"]
    return result


def resolve_binary(args: argparse.Namespace) -> Path:
    """``--llama-bench`` when given (never rebuilt), else a build under ``--workdir``."""
    if args.llama_bench:
        return Path(args.llama_bench)
    if not args.workdir:
        raise SystemExit("give --llama-bench PATH or --workdir DIR")
    return build_llama_cpp(Path(args.workdir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bench", default=None, help="existing llama-bench binary")
    ap.add_argument("--workdir", default=None, help="where to download and build llama.cpp")
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF files to bench")
    ap.add_argument("--hf-dir", default=None, help="HF folder to convert to a bf16 GGUF")
    ap.add_argument("--convert-python", default=sys.executable)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    binary = resolve_binary(args)
    ggufs = [Path(g) for g in args.gguf]
    if args.hf_dir:
        if not args.workdir:
            raise SystemExit("--hf-dir needs --workdir (the llama.cpp source converts it)")
        src = llama_source(Path(args.workdir))
        ggufs.append(convert_bf16(src, Path(args.hf_dir),
                                  Path(args.workdir) / "model-bf16.gguf", args.convert_python))
    rows = [llama_bench(binary, g, args.threads, args.n_prompt, args.n_gen, args.reps)
            for g in ggufs]
    print(markdown_table(rows, ["model_type", "prefill_tok_s", "decode_tok_s",
                                "decode_ms_per_token"]))
    print(f"\nwrote {write_json('llama_cpp.json', {'args': vars(args), 'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
