"""The in-process engine: frontend, engine core and worker in one process."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from forerun.config import EngineConfig
from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.block_hash import make_block_hasher
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.engine.core import EngineCore
from forerun.engine.output_processor import OutputProcessor
from forerun.engine.processor import Processor, PromptType
from forerun.model.loader import load_model, load_model_config, load_tokenizer
from forerun.model.source import resolve_model
from forerun.outputs import RequestOutput
from forerun.request import Request
from forerun.sampling_params import SamplingParams
from forerun.trace import Tracer
from forerun.worker.executor import Executor
from forerun.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    """Tokenise, schedule, run and detokenise, one ``step()`` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model)
        self.model_config = mc = load_model_config(self.source)
        self.tokenizer = load_tokenizer(self.source)
        self.device = device = config.resolve_device()
        self.dtype = dtype = config.resolve_dtype(device)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the model's "
                f"{mc.max_position_embeddings}")
        self.async_scheduling, depth, why = config.resolve_async()
        logger.info("async scheduling %s (%s), queue depth %d",
                    "on" if self.async_scheduling else "off", why, depth)
        torch.manual_seed(config.seed)

        bs = config.block_size
        self.num_blocks = self._num_blocks(mc, dtype, device)
        self.tracer = Tracer(enabled=config.trace_file is not None)
        kv = KVCacheManager(self.num_blocks, bs, config.enable_prefix_caching)
        defer = config.defer_block_free if config.defer_block_free is not None else depth > 1
        sched_config = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            defer_block_free=defer,
        )
        scheduler_cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(sched_config, kv)
        self._block_hasher = make_block_hasher(bs)

        def make_runner() -> ModelRunner:
            model = load_model(self.source, mc, dtype, device)
            return ModelRunner(
                model, self.num_blocks, bs, mc.num_key_value_heads, mc.head_dim,
                mc.num_hidden_layers, dtype, device, config.max_num_seqs, self.tracer,
            )

        self.executor = Executor(make_runner)
        self.engine_core = EngineCore(self.scheduler, self.executor, depth, self.tracer)
        self.processor = Processor(self.tokenizer, self.max_model_len, mc.vocab_size,
                                   mc.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._busy_wall_s = 0.0
        logger.info("KV cache: %d blocks of %d tokens (%s)", self.num_blocks, bs, dtype)

    def _num_blocks(self, mc: Any, dtype: torch.dtype, device: torch.device) -> int:
        bs = self.config.block_size
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        elem = torch.tensor([], dtype=dtype).element_size()
        per_block = 2 * mc.num_hidden_layers * bs * mc.num_key_value_heads * mc.head_dim * elem
        budget = self.config.kv_cache_bytes(device)
        # More than every sequence at full length can never be used.
        ceiling = self.config.max_num_seqs * math.ceil(self.max_model_len / bs) + 1
        n = min(budget // per_block, ceiling)
        if n < math.ceil(self.max_model_len / bs):
            raise ValueError(
                f"KV cache memory of {budget} bytes holds {n} blocks, fewer than one sequence "
                f"of max_model_len={self.max_model_len} needs; raise kv_cache_memory_bytes or "
                "lower max_model_len")
        return int(n)

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request; raises ValueError before any work starts."""
        processed = self.processor.process_prompt(prompt)
        params = self.processor.process_params(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        request = Request(request_id, processed.prompt_token_ids, params,
                          arrival_time=arrival, block_hasher=self._block_hasher)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, params, arrival)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.output_processor.abort_request(rid)
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_work()

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        core_outputs = self.engine_core.run_step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        self._busy_wall_s += time.perf_counter() - t0
        return outputs

    # ----- stats, shutdown --------------------------------------------------------------
    def reset_stats_window(self) -> None:
        self.tracer.device_busy_s = 0.0
        self._busy_wall_s = 0.0

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        kv = self.scheduler.kv_cache_manager
        return {
            "steps": s.steps,
            "num_preemptions": s.num_preemptions,
            "wasted_tokens": s.wasted_tokens,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "kv_blocks_total": kv.block_pool.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_blocks_deferred": sum(len(b) for _, b in self.scheduler.deferred_frees),
            "async_scheduling": self.async_scheduling,
            "max_concurrent_batches": self.engine_core.max_concurrent_batches,
            "device_busy_fraction": (
                self.tracer.device_busy_s / self._busy_wall_s if self._busy_wall_s else 0.0),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    def write_trace(self) -> None:
        if self.config.trace_file:
            self.tracer.write(self.config.trace_file)

    def shutdown(self) -> None:
        self.executor.shutdown()
