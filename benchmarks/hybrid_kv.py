"""Sliding-window KV memory and the second turn's TTFT: forerun against llama-server.

A random model of Gemma-3-1B's shape (transformers ``Gemma3ForCausalLM``, google/gemma-3-1b's
config: hidden 1152, 26 layers, 4 query heads and 1 KV head of 256, sliding window 512 on five
layers of six, MLP 6912; SmolLM2's tokenizer and 49,152-token vocabulary, as
benchmarks/scale.py uses), written in bf16 and converted with llama.cpp's own
``convert_hf_to_gguf.py``. Two turns of one conversation: turn 1 a long prompt
(``--prompt-len`` tokens, random ids), turn 2 the same plus ``--turn2-extra`` tokens, one
output token each.

- forerun (HF folder, bf16, prefix caching): the request's KV bytes at their peak while turn 1
  runs (``num_live_blocks x kv_bytes_per_block`` from the hybrid manager), next to what every
  layer keeping every block would hold; TTFT of each turn (wall time of a one-token
  ``generate``; turn 2 hits turn 1's blocks in every group).
- llama-server on the GGUF, ``--swa-full`` off and on: its KV cache sizes from its log (the
  whole cache of one slot of ``-c`` tokens: with SWA off the sliding layers hold their
  window), and TTFT of each turn (wall time of ``/completion`` with ``cache_prompt``, and its
  own ``prompt_ms``).

Prints a table and writes JSON. Usage (the full size takes minutes; a tiny run proves the
pipeline)::

    python benchmarks/hybrid_kv.py --work-dir /tmp/hybrid_kv --json /tmp/hybrid_kv.json
    python benchmarks/hybrid_kv.py --work-dir /tmp/hybrid_kv_tiny --layers 6 \\
        --sliding-window 128 --prompt-len 512 --turn2-extra 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from scale import VOCAB, _run, llama_tool, save_tokenizer

DEFAULT_LLAMA_CPP = "/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp"


def gemma3_1b_config(layers: int, window: int) -> Any:
    """google/gemma-3-1b's text config with SmolLM2's vocabulary (and ``layers`` layers)."""
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=1152, intermediate_size=6912, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=window, max_position_embeddings=32768, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def build_files(work: Path, layers: int, window: int, llama_dir: Path, python: str,
                seed: int) -> tuple[Path, Path]:
    """The HF folder and its bf16 GGUF under ``work`` (reused when present)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf, gguf = work / "hf", work / "model-bf16.gguf"
    if not (hf / "config.json").exists():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(gemma3_1b_config(layers, window),
                                                 dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                # Gemma's norm weights are offsets from 1; matrices as scale.py draws them.
                (p.zero_() if "norm" in name else p.normal_(0.0, 0.02))
        tmp = hf.with_name("hf.partial")
        model.save_pretrained(tmp)
        save_tokenizer(tmp, None)
        tmp.rename(hf)
        del model
    if not gguf.exists():
        tmp = gguf.with_suffix(".partial")
        _run([python, str(llama_dir / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
              "--outfile", str(tmp)], work / "logs" / "convert.log")
        tmp.rename(gguf)
    return hf, gguf


def prompts(prompt_len: int, extra: int, seed: int) -> tuple[list[int], list[int]]:
    """Turn 1's ids and turn 2's (turn 1's plus ``extra``): random ordinary tokens."""
    rng = random.Random(seed)
    ids = [rng.randrange(100, VOCAB - 100) for _ in range(prompt_len + extra)]
    return ids[:prompt_len], ids


def run_forerun(hf: Path, turn1: list[int], turn2: list[int], threads: int,
                max_num_batched_tokens: int) -> dict[str, Any]:
    """Turn 1's KV bytes (at their peak, and held once its prompt is in: a few output
    tokens) and both turns' TTFT (turn 2: a one-token generate)."""
    import torch

    from forerun import LLM, SamplingParams
    from forerun.core.kv_cache_spec import kv_bytes_per_block

    torch.set_num_threads(threads)
    llm = LLM(str(hf), dtype="bfloat16", max_model_len=len(turn2) + 16, block_size=16,
              enable_prefix_caching=True, max_num_batched_tokens=max_num_batched_tokens)
    try:
        engine = llm.llm_engine
        kv = engine.scheduler.kv_cache_manager
        mc = engine.model_info.model_config
        groups = getattr(kv, "kv_cache_groups", None)
        per_block = (kv_bytes_per_block(groups, kv.block_size, mc.num_key_value_heads,
                                        mc.head_dim, 2) if groups
                     else 2 * mc.num_hidden_layers * kv.block_size * mc.num_key_value_heads
                     * mc.head_dim * 2)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        # A few output tokens: the decode steps after the prompt hold the steady state.
        engine.add_request("turn1", {"prompt_token_ids": turn1},
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        peak = held = 0
        ttft1 = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if ttft1 is None and any(o.outputs and o.outputs[0].token_ids for o in outs):
                ttft1 = time.perf_counter() - t0
            if "turn1" in getattr(kv, "group_req_to_blocks", kv.req_to_blocks):
                held = kv.num_live_blocks("turn1")
                peak = max(peak, held)
        while engine.engine_core.has_work():
            engine.step()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": turn2}], params, use_tqdm=False)[0]
        ttft2 = time.perf_counter() - t0
        all_full = (-(-len(turn1) // kv.block_size) * 2 * mc.num_hidden_layers * kv.block_size
                    * mc.num_key_value_heads * mc.head_dim * 2)
        return {"kv_bytes_per_request": held * per_block, "kv_bytes_peak": peak * per_block,
                "kv_bytes_all_layers_full": all_full,
                "kv_groups": len(groups) if groups else 1, "ttft1_s": ttft1,
                "ttft2_s": ttft2, "turn2_cached_tokens": out.num_cached_tokens}
    finally:
        llm.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def run_llama_server(llama_dir: Path, gguf: Path, turn1: list[int], turn2: list[int],
                     threads: int, swa_full: bool, log: Path) -> dict[str, Any]:
    """llama-server (one slot of the conversation's length): KV sizes from its log, and each
    turn's TTFT with ``cache_prompt``."""
    port = _free_port()
    cmd = [str(llama_tool(llama_dir, "llama-server")), "-m", str(gguf), "-c",
           str(len(turn2) + 16), "-np", "1", "-t", str(threads), "--port", str(port),
           "--host", "127.0.0.1", "-lv", "4"] + (["--swa-full"] if swa_full else [])
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; log {log}:\n"
                                   + log.read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        out: dict[str, Any] = {}
        for name, ids in (("1", turn1), ("2", turn2)):
            t0 = time.perf_counter()
            res = _post(port, {"prompt": ids, "n_predict": 1, "cache_prompt": True,
                               "temperature": 0})
            out[f"ttft{name}_s"] = time.perf_counter() - t0
            timings = res.get("timings", {})
            out[f"prompt_ms{name}"] = timings.get("prompt_ms")
            out[f"prompt_n{name}"] = timings.get("prompt_n")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # "llama_kv_cache: size =   52.00 MiB (  8448 cells, ...": one per cache, the full
    # layers' and the sliding layers' (``-lv 4`` logs them).
    sizes = [float(m) for m in re.findall(r"llama_kv_cache: size =\s*([\d.]+) MiB",
                                          log.read_text(errors="replace"))]
    out["kv_bytes_per_request"] = int(sum(sizes) * 2**20) if sizes else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/hybrid_kv"))
    ap.add_argument("--llama-cpp-dir", type=Path, default=Path(DEFAULT_LLAMA_CPP))
    ap.add_argument("--convert-python", default=sys.executable)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--turn2-extra", type=int, default=200)
    ap.add_argument("--layers", type=int, default=26, help="Gemma-3-1B: 26")
    ap.add_argument("--sliding-window", type=int, default=512, help="Gemma-3-1B: 512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="forerun's prefill chunk (its default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", nargs="+", default=["forerun", "llama-server"],
                    choices=["forerun", "llama-server"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    hf, gguf = build_files(args.work_dir, args.layers, args.sliding_window, args.llama_cpp_dir,
                           args.convert_python, args.seed)
    turn1, turn2 = prompts(args.prompt_len, args.turn2_extra, args.seed)
    rows: dict[str, dict[str, Any]] = {}
    if "forerun" in args.engines:
        rows["forerun"] = run_forerun(hf, turn1, turn2, args.threads,
                                      args.max_num_batched_tokens)
    if "llama-server" in args.engines:
        for swa_full in (False, True):
            name = f"llama-server --swa-full {'on' if swa_full else 'off'}"
            rows[name] = run_llama_server(
                args.llama_cpp_dir, gguf, turn1, turn2, args.threads, swa_full,
                args.work_dir / "logs" / f"server-swa-full-{int(swa_full)}.log")
    print(f"\nGemma-3-1B-shaped ({args.layers} layers, window {args.sliding_window}), turn 1 "
          f"{len(turn1)} tokens, turn 2 {len(turn2)}, {args.threads} threads")
    print(f"{'engine':<28} {'KV MiB/request':>15} {'TTFT turn 1 s':>14} {'TTFT turn 2 s':>14} "
          f"{'turn 2 computed':>16}")
    for name, r in rows.items():
        kv_b = r.get("kv_bytes_per_request")
        kv_s = f"{kv_b / 2**20:.1f}" if kv_b else "?"
        computed = (len(turn2) - r["turn2_cached_tokens"] if "turn2_cached_tokens" in r
                    else r.get("prompt_n2"))
        print(f"{name:<28} {kv_s:>15} {r['ttft1_s']:>14.3f} {r['ttft2_s']:>14.3f} "
              f"{computed if computed is not None else '?':>16}")
    if "forerun" in rows:
        f = rows["forerun"]
        print(f"(forerun: KV held once the prompt is in; its peak during the prompt's chunks "
              f"{f['kv_bytes_peak'] / 2**20:.1f} MiB; every layer keeping every block "
              f"{f['kv_bytes_all_layers_full'] / 2**20:.1f} MiB; turn 2 cached "
              f"{f['turn2_cached_tokens']} tokens)")
    result = {"config": {k: str(v) if isinstance(v, Path) else v
                         for k, v in vars(args).items()}, "rows": rows,
              "cpus": os.cpu_count()}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
