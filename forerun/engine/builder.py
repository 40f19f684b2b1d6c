"""Builds an engine core (scheduler + executor + model) from an EngineConfig."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from forerun.config import EngineConfig
from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.hybrid_kv_cache_manager import make_kv_cache_manager
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, one_group
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.distributed.pipeline_parallel import check_pipeline_parallel
from forerun.distributed.tensor_parallel import check_tensor_parallel
from forerun.engine.core import EngineCore
from forerun.model.info import ModelInfo, num_kv_blocks, resolve_model_info
from forerun.model.loader import load_model
from forerun.model.tokenizer import load_tokenizer
from forerun.spec_decode.config import SpeculativeConfig
from forerun.structured.backend import XgrammarBackend
from forerun.structured.manager import StructuredOutputManager
from forerun.trace import Tracer
from forerun.worker.executor import Executor
from forerun.worker.model_runner import ModelRunner
from forerun.worker.multiproc_executor import MultiprocExecutor
from forerun.worker.simulated import SimulatedModelRunner, parse_simulated_device

logger = logging.getLogger(__name__)


# Engines in one process that serve the same weights share one read-only model (tests
# and benchmarks build several engines); it is freed when the last engine goes away.
_MODELS: weakref.WeakValueDictionary[tuple, torch.nn.Module] = weakref.WeakValueDictionary()
_TOKENIZERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def shared_model(info: ModelInfo, dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None) -> torch.nn.Module:
    # longrope models rotate by one of two factor sets, chosen by the engine's context.
    key = (str(info.source.path), info.source.gguf_file, dtype, str(device), quantization,
           info.model_config.uses_long_rope_factors())
    model = _MODELS.get(key)
    if model is None:
        model = load_model(info.source, info.model_config, dtype, device, quantization)
        _MODELS[key] = model
    return model


def shared_tokenizer(info: ModelInfo) -> Any:
    source = info.tokenizer_from
    key = f"{source.path}|{source.gguf_file}"
    tok = _TOKENIZERS.get(key)
    if tok is None:
        tok = load_tokenizer(source, info.model_config.architecture)
        _TOKENIZERS[key] = tok
    return tok


def engine_kv_cache_groups(config: EngineConfig, info: ModelInfo) -> list[KVCacheGroupSpec]:
    """The model's KV cache groups (docs/kv_cache.md); one group of every layer where the
    runner keeps one block table: tensor and pipeline parallel ranks, the simulated device."""
    mc = info.model_config
    groups = kv_cache_groups(mc)
    if len(groups) > 1 and (config.world_size > 1 or config.simulated_device is not None):
        # Their runners are built with one table for every layer (multiproc_executor.py,
        # simulated.py): the sliding layers keep every block, as before the hybrid manager.
        logger.info("hybrid KV cache off (%s): every layer keeps every block",
                    "tensor/pipeline parallel" if config.world_size > 1 else "simulated device")
        return one_group(mc.num_hidden_layers)
    return groups


def fitting_model_len(kv: KVCacheManager, max_model_len: int, max_chunk: int) -> int:
    """The longest sequence (at most ``max_model_len``) whose most blocks at once fit the
    whole cache: ``num_blocks * block_size`` with one group, more with sliding groups."""
    if kv.max_blocks_per_request(max_model_len, max_chunk) <= kv.num_blocks:
        return max_model_len
    lo, hi = 0, max_model_len  # fits(lo), not fits(hi); blocks needed grow with the length
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv.max_blocks_per_request(mid, max_chunk) <= kv.num_blocks:
            lo = mid
        else:
            hi = mid
    return lo


def build_engine_core(config: EngineConfig, info: ModelInfo | None = None) -> EngineCore:
    """Load the model on a worker thread and wire scheduler, executor and core together."""
    info = info or resolve_model_info(config)
    mc = info.model_config
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    spec_config = SpeculativeConfig.from_dict(config.speculative_config)
    async_on, depth, why = config.resolve_async()
    logger.info("async scheduling %s (%s), queue depth %d", "on" if async_on else "off",
                why, depth)
    torch.manual_seed(config.seed)
    bs = config.block_size
    groups = engine_kv_cache_groups(config, info)
    num_blocks = num_kv_blocks(config, info, dtype, device, groups)
    kv = make_kv_cache_manager(groups, num_blocks, bs, config.enable_prefix_caching)
    fits = fitting_model_len(kv, info.max_model_len, config.max_num_batched_tokens)
    if fits < info.max_model_len:
        # A sequence that outgrows the whole cache could only preempt itself forever.
        logger.warning("max_model_len %d does not fit in %d KV blocks of %d; lowering it to %d",
                       info.max_model_len, num_blocks, bs, fits)
        info.max_model_len = fits
    tracer = Tracer(enabled=config.trace_file is not None)
    defer = config.defer_block_free if config.defer_block_free is not None else depth > 1
    sched_config = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=info.max_model_len,
        defer_block_free=defer,
        num_speculative_tokens=spec_config.num_speculative_tokens if spec_config else 0,
        pipeline_parallel_size=config.pipeline_parallel_size,
    )
    if spec_config is not None:
        logger.info("speculative decoding: %s, %d drafts per step", spec_config.method,
                    spec_config.num_speculative_tokens)
    # Tokenizer info for the grammars is built on the first grammar request, not here.
    grammar_backend = XgrammarBackend(lambda: shared_tokenizer(info), info.vocab_size,
                                      info.eos_token_ids)
    structured = StructuredOutputManager(
        grammar_backend, compile_timeout_s=config.structured_outputs_compile_timeout_s)
    sched_conn, worker_conn = _kv_connectors(config, info, dtype, bs)
    scheduler = (AsyncScheduler if async_on else Scheduler)(sched_config, kv, structured,
                                                            sched_conn)

    def make_runner() -> ModelRunner:
        if config.simulated_device is not None:
            sim_device, shape = parse_simulated_device(config.simulated_device)
            return SimulatedModelRunner(sim_device, shape, num_blocks, bs, config.max_num_seqs,
                                        mc.vocab_size, tracer=tracer)
        model = shared_model(info, dtype, device, config.quantization)
        return ModelRunner(model, num_blocks, bs, mc.num_key_value_heads, mc.head_dim,
                           mc.num_hidden_layers, dtype, device, config.max_num_seqs, tracer,
                           vocab_size=mc.vocab_size, speculative_config=spec_config,
                           kv_cache_groups=groups if len(groups) > 1 else None,
                           kv_cache_dtype=config.resolve_kv_cache_dtype(dtype),
                           kv_connector=worker_conn)

    if config.world_size > 1:
        check_tensor_parallel(mc, config.tensor_parallel_size)
        check_pipeline_parallel(mc, config.pipeline_parallel_size)
        executor: Executor | MultiprocExecutor = MultiprocExecutor(
            config, info, num_blocks, tracer, spec_config)
    else:
        executor = Executor(make_runner)
    logger.info("KV cache: %d blocks of %d tokens (%s)", num_blocks, bs, dtype)
    return EngineCore(scheduler, executor, depth, tracer, async_scheduling=async_on)


def _kv_connectors(config: EngineConfig, info: ModelInfo, dtype: torch.dtype, block_size: int
                   ) -> tuple[Any, Any]:
    """(scheduler half, worker half) of the configured KV connector, or (None, None)."""
    kv_transfer = config.resolve_kv_transfer()
    if kv_transfer is None:
        return None, None
    from forerun.kv_connector.factory import KVLayout, make_kv_connectors
    mc = info.model_config
    # What the KV bytes depend on: the weights (where they come from, how they are
    # quantized) and the architecture; the dtype and layout are KVLayout's own fields.
    model_id = f"{info.source.path}|{info.source.gguf_file}|q={config.quantization}|{mc!r}"
    portable_id = f"{info.source.name}|{info.source.gguf_file}|q={config.quantization}|{mc!r}"
    layout = KVLayout(model_id, dtype, mc.num_hidden_layers, mc.num_key_value_heads,
                      mc.head_dim, block_size, portable_id)
    ram = int((config.kv_offloading_size or 0) * (1 << 30))
    return make_kv_connectors(kv_transfer, layout, ram, config.kv_offload_dir)
