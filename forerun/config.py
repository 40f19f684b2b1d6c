"""Engine configuration: the user's knobs and how they resolve."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from forerun.model.kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from forerun.sampling_params import check_int

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
_DEFAULT_CPU_KV_BYTES = 2 << 30


def _json_dict(text: str) -> dict[str, Any]:
    """A command-line JSON object (``--speculative-config``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _opt(default: Any, help: str, **flag: Any) -> Any:
    """A config field with what its command-line flag needs (:mod:`forerun.engine_args`):
    ``help``, and optionally ``short`` (an alias), ``choices``, ``negative`` (a flag that
    turns it off) and ``parse`` (the string-to-value function)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs to start, with vLLM's names where vLLM has the knob."""

    model: str | None = _opt(
        None, "local GGUF file or HF-style folder (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = _opt(
        None, "an HF-style folder (or GGUF) whose tokenizer to use instead of the model's "
              "own; for a GGUF model its base model's folder saves converting the GGUF "
              "vocabulary, which takes seconds")
    dtype: str = _opt("auto", "auto, float32, bfloat16 or float16 (CUDA only)")
    device: str = _opt("auto", "auto, cpu or cuda")
    max_model_len: int | None = _opt(None, "the longest prompt + output (default: the model's)")
    max_num_seqs: int = _opt(256, "the most sequences in one step")
    max_num_batched_tokens: int = _opt(
        2048, "the per-step token budget; prefill is chunked by it")
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_dtype: str = _opt(
        "auto", "the KV cache's storage: auto (the model dtype), int8, fp8 (= fp8_e4m3) or "
                "fp8_e5m2, 1 byte a value with a scale per block and head (docs/kv_cache.md); "
                "or bfloat16, float16, float32", choices=tuple(KV_CACHE_DTYPES))
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of shared prompt prefixes")
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV cache size in bytes (default: 2 GiB on CPU, a share of free memory on CUDA)")
    gpu_memory_utilization: float = _opt(
        0.9, "CUDA: the share of free device memory the KV cache takes")
    num_gpu_blocks_override: int | None = _opt(None, "this many KV blocks, whatever the memory")
    seed: int = _opt(0, "the seed of unseeded sampling")
    async_scheduling: str | bool | None = _opt(
        "auto", "plan step N+1 while step N runs", choices=("auto", "on", "off"),
        negative="--no-async-scheduling")
    max_concurrent_batches: int | None = _opt(
        None, "steps in flight at once (default: 2 with async scheduling, 1 without)")
    defer_block_free: bool | None = _opt(
        None, "free a finished request's blocks only once no step in flight can write them "
              "(default: on when more than one step is in flight)")
    trace_file: str | None = _opt(None, "write a Chrome trace of engine and worker activity here")
    structured_outputs_compile_timeout_s: float = _opt(
        30.0, "a grammar still compiling after this many seconds fails its request")
    max_logprobs: int = _opt(
        20, "the most logprobs a request may ask for; -1 for the whole vocabulary")
    quantization: str | None = _opt(
        None, "gguf (compute with a GGUF's quantized blocks) or int8; default: the exact path, "
              "weights dequantized to dtype", short="-q")
    speculative_config: dict[str, Any] | None = _opt(
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (methods: ngram, '
              "suffix)", parse=_json_dict)
    runner: str = _opt(
        "generate", "generate (text) or pooling (embeddings and scores; generation requests "
                    "are refused); auto is generate for the decoder models forerun runs",
        choices=("auto", "generate", "pooling"))
    pooler_config: dict[str, Any] | None = _opt(
        None, 'JSON, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST, '
              "MEAN or CLS; normalize; dimensions): how pooling requests pool by default",
        parse=_json_dict)
    simulated_device: str | None = _opt(
        None, "DEVICE[/MODEL], e.g. h100/llama-3-8b: the forward only sleeps for its modelled "
              "step time (to measure the host side)")
    data_parallel_size: int = _opt(
        1, "engine cores behind one server, each on its own share of the CPUs", short="-dp")
    data_parallel_rank: int = _opt(0, "this engine core's data-parallel rank (set per core)")
    tensor_parallel_size: int = _opt(
        1, "split each engine's model over this many processes (torch.distributed)",
        short="-tp")
    enable_expert_parallel: bool = _opt(
        False, "mixture-of-experts models with tensor_parallel_size > 1: each rank holds "
               "whole experts (num_experts / tensor_parallel_size of them) instead of a "
               "slice of every expert")
    pipeline_parallel_size: int = _opt(
        1, "split each engine's layers into this many stages, one process group of "
           "tensor_parallel_size ranks each (torch.distributed); the batch queue is this deep "
           "(+ 1 with async)", short="-pp")
    kv_transfer_config: dict[str, Any] | None = _opt(
        None, 'JSON in vLLM\'s KVTransferConfig shape, e.g. \'{"kv_connector": '
              '"OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
              '{"disk_bytes": 8589934592}}\' (see docs/kv_connector.md)', parse=_json_dict)
    kv_offloading_size: float | None = _opt(
        None, "GiB of host RAM for offloaded KV blocks (turns on the OffloadingConnector)")
    kv_offload_dir: str | None = _opt(
        None, "a folder for the offloaded KV blocks' disk tier (turns on the "
              "OffloadingConnector; blocks survive restarts, keyed by model and dtype)")
    nnodes: int = _opt(
        1, "machines the engine's ranks spread over: node 0 runs the engine and its share of "
           "the ranks; every other node runs only ranks")
    node_rank: int = _opt(0, "this machine's index; nodes other than 0 run ranks only")
    master_addr: str | None = _opt(
        None, "rendezvous host (default: MASTER_ADDR, else 127.0.0.1)")
    master_port: int | None = _opt(
        None, "rendezvous port (default: MASTER_PORT, else a free one, which only a single "
              "node can use; needed with nnodes > 1)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be at least 1")
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # the name, checked early
        if self.max_concurrent_batches is not None and self.max_concurrent_batches < 1:
            raise ValueError("max_concurrent_batches must be at least 1")
        resolve_async_mode(self.async_scheduling)  # validates
        check_int("data_parallel_size", self.data_parallel_size, 1, 1 << 16)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 1 << 16)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1, 1 << 16)
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got "
                             f"{self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must divide tensor_parallel_size * "
                             f"pipeline_parallel_size={self.world_size} (each node runs as "
                             "many ranks)")
        if self.pipeline_parallel_size > 1:
            for what, bad in (("quantization", self.quantization is not None),
                              ("speculative_config", bool(self.speculative_config))):
                if bad:
                    raise ValueError(f"pipeline_parallel_size > 1 does not support {what} "
                                     "yet; drop one of them")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("nnodes: data parallel runs on one machine; use nnodes=1")
        if self.nnodes > 1 and self.rendezvous()[1] is None:
            raise ValueError("master_port (or MASTER_PORT) is needed when nnodes > 1, so that "
                             "every node finds the same rendezvous")
        if self.world_size > 1 and self.simulated_device is not None:
            raise ValueError("tensor_parallel_size / pipeline_parallel_size: the simulated "
                             "device runs one process")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank!r}")
        from forerun.spec_decode.config import SpeculativeConfig
        SpeculativeConfig.from_dict(self.speculative_config)  # validates
        self._check_kv_transfer()
        self._check_pooling()
        if self.simulated_device is not None:
            from forerun.worker.simulated import parse_simulated_device
            parse_simulated_device(self.simulated_device)
            if self.speculative_config:
                raise ValueError("simulated_device: speculative decoding needs the real model")

    def resolve_kv_transfer(self) -> Any:
        """The KVTransferConfig in use, or None: ``kv_transfer_config``, or the offloading
        connector that ``kv_offloading_size`` / ``kv_offload_dir`` imply."""
        from forerun.kv_connector.config import KVTransferConfig
        config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if config is None and (self.kv_offloading_size or self.kv_offload_dir):
            config = KVTransferConfig("OffloadingConnector")
        return config

    def _check_kv_transfer(self) -> None:
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got "
                             f"{self.kv_offloading_size}")
        if self.resolve_kv_transfer() is None:
            return
        if not self.enable_prefix_caching:
            raise ValueError("kv_transfer_config: a KV connector hands the blocks it loads to "
                             "the request through the prefix cache; enable_prefix_caching "
                             "must stay on")
        for what, bad in (("tensor/pipeline parallel", self.world_size > 1),
                          ("simulated_device", self.simulated_device is not None),
                          # Its payloads are the (K, V) pages, not a quantized cache's scales.
                          (f"kv_cache_dtype={self.kv_cache_dtype}",
                           self.kv_cache_dtype != "auto"),
                          ("defer_block_free=False with steps in flight",
                           self.defer_block_free is False
                           and self.resolve_async()[1] > 1)):
            if bad:
                raise ValueError(f"kv_transfer_config: a KV connector does not support "
                                 f"{what} yet")

    def _check_pooling(self) -> None:
        from forerun.pooling_params import PoolerConfig
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got "
                             f"{self.runner!r}")
        PoolerConfig.from_dict(self.pooler_config)  # validates
        if self.runner == "pooling":
            for what, bad in (("pipeline_parallel_size > 1", self.pipeline_parallel_size > 1),
                              ("simulated_device", self.simulated_device is not None),
                              ("speculative_config", bool(self.speculative_config))):
                if bad:
                    raise ValueError(f"runner: the pooling runner does not support {what}")

    @property
    def supports_pooling(self) -> bool:
        """Whether pooling requests can run: the worker pools where it holds the whole
        model's final hidden states (not across pipeline stages, not on a simulated
        device)."""
        return self.pipeline_parallel_size == 1 and self.simulated_device is None

    @property
    def world_size(self) -> int:
        """Processes that run one engine's model: tensor x pipeline parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rendezvous(self) -> tuple[str, int | None]:
        """(address, port) where the tensor-parallel ranks meet; port None = any free one."""
        from forerun import envs
        addr = self.master_addr or envs.master_addr() or "127.0.0.1"
        port = self.master_port if self.master_port is not None else envs.master_port()
        return addr, port

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            if device.type == "cuda":
                return torch.bfloat16
            # bf16 is 2-3x faster than fp32 where the CPU has AMX/AVX512-BF16.
            cap = torch.backends.cpu.get_cpu_capability()
            return torch.bfloat16 if cap in ("AVX512", "AMX") or "AMX" in cap else torch.float32
        try:
            dt = _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(
                f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {self.dtype!r}"
            ) from None
        if dt == torch.float16 and device.type == "cpu":
            raise ValueError("dtype float16 is supported on CUDA only; use bfloat16 on CPU")
        return dt

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for a model computing in ``model_dtype``."""
        dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model_dtype)
        if dtype == torch.float16 and model_dtype != torch.float16:
            raise ValueError("kv_cache_dtype float16 needs dtype float16 (CUDA); use auto, "
                             "bfloat16, int8 or fp8")
        if dtype.is_floating_point and dtype.itemsize > 1 and dtype != model_dtype:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} differs from the model "
                             f"dtype {model_dtype}; use auto, int8 or fp8")
        return dtype

    def resolve_async(self) -> tuple[bool, int, str]:
        """Return (async on, queue depth, why) for this configuration.

        The default depth is one step per pipeline stage, so that every stage has a step,
        plus one with async scheduling, so that the next step is already scheduled when
        the first stage frees up (the seed's ``max_concurrent_batches``).
        """
        mode = resolve_async_mode(self.async_scheduling)
        depth = self.max_concurrent_batches
        pp = self.pipeline_parallel_size
        if mode == "off":
            if depth not in (None, 1) and pp == 1:
                raise ValueError("max_concurrent_batches > 1 needs async scheduling (or "
                                 "pipeline_parallel_size > 1)")
            return False, depth or pp, "turned off by the user"
        if depth == 1:
            if mode == "on":
                raise ValueError("async scheduling needs max_concurrent_batches >= 2")
            return False, 1, "max_concurrent_batches=1 leaves nothing to overlap"
        why = "requested" if mode == "on" else (
            "auto: nothing in use needs the previous step's token before the next forward")
        return True, depth or pp + 1, why

    def kv_cache_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            return int(free * self.gpu_memory_utilization)
        return _DEFAULT_CPU_KV_BYTES


def resolve_async_mode(value: str | bool | None) -> str:
    if value is None or value == "auto":
        return "auto"
    if value is True or value == "on":
        return "on"
    if value is False or value == "off":
        return "off"
    raise ValueError(f"async_scheduling must be 'auto', 'on' or 'off', got {value!r}")
