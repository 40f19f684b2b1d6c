"""The in-process engine: frontend, engine core and worker in one process."""

from __future__ import annotations

import logging
import time

from forerun.config import EngineConfig
from forerun.core.block_hash import make_block_hasher
from forerun.core.stats import EngineStats
from forerun.engine.builder import build_engine_core, resolve_model_info, shared_tokenizer
from forerun.engine.output_processor import OutputProcessor
from forerun.engine.parallel_sampling import ParallelSampling
from forerun.engine.processor import ProcessedPrompt, PromptType, make_processor
from forerun.outputs import PoolingRequestOutput, RequestOutput
from forerun.pooling_params import PoolingParams, pooling_sampling_params
from forerun.request import Request
from forerun.sampling_params import SamplingParams
from forerun.trace import ENGINE_LANE

logger = logging.getLogger(__name__)


class LLMEngine:
    """Tokenise, schedule, run and detokenise, one ``step()`` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_info = info = resolve_model_info(config)
        self.tokenizer = shared_tokenizer(info)
        self.engine_core = build_engine_core(config, info)
        self.scheduler = self.engine_core.scheduler
        self.executor = self.engine_core.executor
        self.tracer = self.engine_core.tracer
        self.async_scheduling = self.engine_core.async_scheduling
        self.max_model_len = info.max_model_len
        self._block_hasher = make_block_hasher(config.block_size)
        self.processor = make_processor(config, info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._parallel = ParallelSampling()

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request; raises ValueError before any work starts.

        With ``params.n > 1`` the request is fanned out into n children (see
        :mod:`forerun.engine.parallel_sampling`); ``step()`` reports the parent.
        """
        processed = self.processor.process_prompt(prompt, params.truncate_prompt_tokens)
        params = self.processor.process_params(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        # Back to back, so one scheduling step admits them all and they share the prompt.
        for rid, p in self._parallel.fan_out(request_id, params):
            self._add_one(rid, processed, p, arrival)

    def _add_one(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams,
                 arrival: float) -> None:
        request = Request(request_id, processed.prompt_token_ids, params,
                          arrival_time=arrival, block_hasher=self._block_hasher)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, params, arrival)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            arrival_time: float | None = None) -> None:
        """Validate and queue one pooling (embedding) request; ValueError before any work.

        The request is prefill-only: ``step()`` reports one PoolingRequestOutput for it,
        when its last prompt position has been computed.
        """
        params = self.processor.process_pooling_params(params)
        processed = self.processor.process_prompt(prompt, params.truncate_prompt_tokens)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        request = Request(request_id, processed.prompt_token_ids, pooling_sampling_params(),
                          arrival_time=arrival, block_hasher=self._block_hasher,
                          pooling_params=params)
        self.engine_core.add_request(request)
        self.output_processor.add_pooling_request(request_id, processed.prompt,
                                                  processed.prompt_token_ids, params, arrival)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by id; a parallel-sampling parent aborts all its children."""
        engine_ids = [eid for rid in request_ids for eid in self._parallel.forget(rid)]
        for rid in engine_ids:
            self.output_processor.abort_request(rid)
        self.engine_core.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_work()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        core_outputs = self.engine_core.run_step()
        with self.tracer.span("output", ENGINE_LANE):
            outputs, to_abort = self.output_processor.process_outputs(core_outputs)
            outputs = self._parallel.merge(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        return outputs

    # ----- stats, shutdown --------------------------------------------------------------
    def reset_stats_window(self) -> None:
        self.engine_core.reset_stats_window()

    def close_stats_window(self) -> None:
        self.engine_core.close_stats_window()

    def stats(self) -> EngineStats:
        return self.engine_core.stats()

    def write_trace(self) -> None:
        if self.config.trace_file:
            self.tracer.write(self.config.trace_file)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
