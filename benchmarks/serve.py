"""Serve SmolLM2 with forerun (async on and off) and measure it at several concurrencies,
with ``forerun bench serve`` or vLLM's own ``vllm bench serve`` as the load generator; with
``--vllm-python``/``--vllm-model`` also vLLM's CPU build, side by side.

    python benchmarks/serve.py [--concurrency 1 8 32] [--num-prompts 64]
    python benchmarks/serve.py --vllm-python /path/to/vllm-venv/bin/python --vllm-model DIR
    python benchmarks/serve.py --client vllm --vllm-python PY --vllm-model DIR \\
        --servers forerun-on vllm
    python benchmarks/serve.py --client vllm --vllm-python PY --tokenizer DIR \\
        --servers forerun-on --concurrency 2 --num-prompts 4 --input-len 16 --output-len 8

``--client forerun`` (default): ``forerun bench serve``, concurrencies 1 8 32 and 64 prompts
at each unless given. ``--client vllm``: ``vllm bench serve`` run with ``--vllm-python``
(through vllm_bench_client.py) on its random dataset, ``--ignore-eos``, seed 0 and no
sampling parameters sent (the servers' default, temperature 1.0); concurrencies 1 8 32 64 and
``max(8, 2 * concurrency)`` prompts at each unless ``--num-prompts`` is given. Its tokenizer
is an HF folder: ``--tokenizer``, else ``--vllm-model``. Every server serves the model under
one name (``--served-model-name SmolLM2-135M-Instruct``), so either client can address
either server. ``--servers`` picks a subset of forerun-on, forerun-off, forerun-gguf (async
on, ``--quantization gguf``: the default model's own Q4_1/Q8_0 blocks, as llama.cpp computes
with them, where the other forerun rows dequantize them to ``--dtype``) and vllm; vllm needs
``--vllm-python`` and ``--vllm-model``. With vLLM's server in the run, the forerun/vLLM ratio
of output tok/s is printed per concurrency. ``--rounds N`` runs the whole sequence N times,
the servers in turn, and takes the ratios from medians: one round runs every concurrency of
one server before the next, so a machine that slows down mid-run biases the ratio.

vLLM needs an HF folder (see ../shared/reference/peer-baselines.md for how to make one from
the GGUF) and its own virtual environment; it is skipped when not given.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import markdown_table, write_json

from forerun.bench.serve import wait_until_healthy

MODEL_NAME = "SmolLM2-135M-Instruct"
VLLM_CLIENT = Path(__file__).resolve().parent / "vllm_bench_client.py"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
SERVER_KEYS = ("forerun-on", "forerun-off", "forerun-gguf", "vllm")
ROW_KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
            "failed")
COLUMNS = ["server", "concurrency", "num_prompts", "output_tok_s", "req_s", "mean_ttft_ms",
           "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
           "mean_e2el_ms", "failed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc.poll, timeout_s=300.0, poll_s=1.0)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    # vLLM's client: enough prompts to keep every slot busy twice over, without making the
    # low concurrencies take minutes.
    return 64 if args.client == "forerun" else max(8, 2 * concurrency)


def bench_forerun(port: int, concurrency: int, n: int, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "forerun.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(n),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--ignore-eos", "--max-concurrency", str(concurrency), "--disable-tqdm",
           "--result-file", out, "--model", MODEL_NAME]
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def bench_vllm(port: int, concurrency: int, n: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [args.vllm_python, str(VLLM_CLIENT), "--backend", "openai",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
               "--model", MODEL_NAME, "--tokenizer", args.tokenizer,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(n),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
               # e2el too, so that the rows have the columns forerun's client gives
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
               "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        out = Path(tmp) / "result.json"
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"vllm bench serve failed (rc {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())


def server_commands(args: argparse.Namespace
                    ) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    servers: dict[str, tuple[list[str], dict[str, str] | None]] = {}
    forerun = {"forerun-on": ("forerun async=on", ["--async-scheduling", "on"]),
               "forerun-off": ("forerun async=off", ["--async-scheduling", "off"]),
               "forerun-gguf": ("forerun gguf", ["--async-scheduling", "on",
                                                 "--quantization", "gguf"])}
    for key, (name, flags) in forerun.items():
        if key in args.servers:
            servers[name] = (
                [sys.executable, "-m", "forerun.cli", "serve", "--dtype", args.dtype, *flags,
                 "--max-model-len", "2048", "--served-model-name", MODEL_NAME,
                 *shlex.split(args.forerun_args)], None)
    if "vllm" in args.servers and args.vllm_python and args.vllm_model:
        servers["vLLM CPU (sync)"] = (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
             args.vllm_model, "--dtype", args.dtype, "--max-model-len", "2048",
             "--served-model-name", MODEL_NAME], VLLM_ENV)
    return servers


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (server, concurrency): the median of each number over the rounds."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["concurrency"]), []).append(r)
    out = []
    for (server, c), rs in groups.items():
        row: dict[str, Any] = {"server": server, "concurrency": c, "round": "median"}
        for key in rs[0]:
            values = [r[key] for r in rs]
            if key not in row and all(isinstance(v, (int, float)) for v in values):
                row[key] = statistics.median(values)
        out.append(row)
    return out


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """forerun output tok/s over vLLM's, per concurrency (empty without a vLLM server)."""
    vllm = {r["concurrency"]: r["output_tok_s"] for r in rows if r["server"].startswith("vLLM")}
    out = []
    for c, base in vllm.items():
        line: dict[str, Any] = {"concurrency": c}
        for r in rows:
            if r["server"].startswith("forerun") and r["concurrency"] == c and base:
                line[f"{r['server']} / vLLM"] = r["output_tok_s"] / base
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--client", choices=("forerun", "vllm"), default="forerun",
                    help="load generator: forerun bench serve or vllm bench serve")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="default 1 8 32 (forerun client), 1 8 32 64 (vllm client)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="default 64 (forerun client), max(8, 2 * concurrency) (vllm client)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--servers", nargs="+", choices=SERVER_KEYS, default=list(SERVER_KEYS))
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--vllm-model", default=None, help="HF folder of SmolLM2 for vLLM")
    ap.add_argument("--tokenizer", default=None,
                    help="HF folder for vllm bench serve's tokenizer (default: --vllm-model)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every server this many times, in turn; tables report medians")
    ap.add_argument("--forerun-args", default="",
                    help="extra flags for forerun serve, one string, e.g. "
                         "'--max-num-batched-tokens 1024'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.concurrency is None:
        args.concurrency = [1, 8, 32] if args.client == "forerun" else [1, 8, 32, 64]
    args.tokenizer = args.tokenizer or args.vllm_model
    if args.client == "vllm" and not (args.vllm_python and args.tokenizer):
        ap.error("--client vllm needs --vllm-python and --tokenizer (or --vllm-model)")
    bench = bench_forerun if args.client == "forerun" else bench_vllm

    # Each round runs every server once, so with --rounds > 1 the servers take turns and a
    # machine whose speed drifts during the run slows all of them, not just the last.
    rows = []
    for rnd in range(args.rounds):
        for name, (cmd, env) in server_commands(args).items():
            port = free_port()
            proc = start([*cmd, "--port", str(port)], port, env)
            try:
                for c in args.concurrency:
                    n = num_prompts(args, c)
                    r = bench(port, c, n, args)
                    row = {"server": name, "concurrency": c, "round": rnd, "num_prompts": n}
                    row.update({k: r.get(k) for k in ROW_KEYS})
                    row["output_tok_s"] = row.pop("output_throughput")
                    row["req_s"] = row.pop("request_throughput")
                    rows.append(row)
                    print(f"{name} c={c} round {rnd}: {row['output_tok_s']:.1f} tok/s",
                          flush=True)
            finally:
                stop(proc)
    table = rows if args.rounds == 1 else rows + median_rows(rows)
    print(markdown_table(table, COLUMNS if args.rounds == 1 else ["round", *COLUMNS]))
    ratios = ratio_rows(rows if args.rounds == 1 else median_rows(rows))
    if ratios:
        print("\nforerun / vLLM, output tok/s:\n")
        print(markdown_table(ratios, list(ratios[0])))
    data = {"args": vars(args), "rows": rows, "medians": median_rows(rows),
            "ratios_vs_vllm": ratios}
    print(f"\nwrote {write_json('serve.json', data, args.json)}")


if __name__ == "__main__":
    main()
