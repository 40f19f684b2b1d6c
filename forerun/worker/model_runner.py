"""The model runner: persistent per-request state, flat inputs, forward, sampling.

The runner does a step's host work itself: request state (worker/input_batch.py) and the
flat inputs (worker/step_inputs.py). The device work, forward and sampling, is its
``backend`` (worker/step_backend.py): the model held here (worker/model_step.py, with
speculative decoding in worker/spec_step.py and the output's copy to the host in
worker/output_plan.py), or one pipeline stage around it (worker/pipeline_stage.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.kv_connector.base import KVConnectorBase, KVConnectorOutput
from forerun.model.attention import new_kv_cache
from forerun.spec_decode.config import SpeculativeConfig
from forerun.trace import WORKER_LANE, Tracer
from forerun.worker.input_batch import InputBatch
from forerun.worker.model_step import ModelStep
from forerun.worker.output_plan import DeferredOutput
from forerun.worker.pipeline_stage import PipelineStage
from forerun.worker.pooler import Pooler
from forerun.worker.sampler import Sampler
from forerun.worker.sampling_state import SamplingState
from forerun.worker.spec_step import SpecDecodeStep
from forerun.worker.step_backend import StepBackend, StepState
from forerun.worker.step_inputs import StepInputs, prepare_inputs

if TYPE_CHECKING:
    from forerun.worker.pipeline import PipelineComm

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the paged KV cache; runs one step at a time, in FIFO order.

    Worker-side substitution: after sampling, the ids stay in ``last_sampled`` (one stable
    row per request); when the next step schedules the position after a request's known
    ids, that row is scattered into the flat input on the device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        tracer: Tracer | None = None,
        vocab_size: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
        pipeline: PipelineComm | None = None,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        self.model = model
        # Pipeline parallel: this runner is one stage (forerun/worker/pipeline.py).
        self.pipeline = pipeline
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tracer = tracer or Tracer()
        self.kv_caches = [
            new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
            for _ in range(num_layers)
        ]
        self.sampler = Sampler()
        self.vocab_size = vocab_size if vocab_size is not None else _vocab_of(model)
        # Penalty counts, bias rows and bad-word history, per slot, on the device.
        self.sampling_state = SamplingState(max_num_seqs, self.vocab_size, device)
        self.speculative_config = speculative_config
        self.spec = (SpecDecodeStep(speculative_config, self.sampler, self.sampling_state,
                                    self.tracer, device) if speculative_config else None)
        self.drafter = self.spec.drafter if self.spec is not None else None
        self.input_batch = InputBatch(max_num_seqs, device, self.sampling_state, self.spec)
        self.requests = self.input_batch.requests
        self.max_num_reqs = max_num_seqs
        self.last_sampled = self.input_batch.last_sampled
        # Partial MEAN/CLS results between a pooling request's chunks (worker/pooler.py).
        self.pooler = Pooler()
        local = ModelStep(model, self.kv_caches, self.requests, self.last_sampled,
                          self.sampler, self.sampling_state, self.spec, self.tracer, device,
                          self.pooler)
        # The device half of every step; a subclass may swap it (worker/simulated.py).
        self.backend: StepBackend = local if pipeline is None else PipelineStage(pipeline, local)
        self._step: StepState | None = None
        # The KV connector's worker half (forerun/kv_connector/): its transfers start before
        # a step's forward and are reported with the step's output.
        self.kv_connector = kv_connector
        self._step_finished_ids: set[str] = set()
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs | None:
        """Apply the step's request changes and build its inputs, placeholders filled;
        None (and an empty step left for sample_tokens) when it schedules nothing."""
        with self.tracer.span("prepare", WORKER_LANE, so.step_id):
            self.input_batch.update_states(so)
            self.pooler.forget(so.finished_req_ids | so.preempted_req_ids)
            req_ids = list(so.num_scheduled_tokens)
            if not req_ids:
                self._step = StepState([], [], None, None, so.step_id)
                return None
            inputs = prepare_inputs(self.requests, so, req_ids, self.block_size, self.device,
                                    with_drafts=self.spec is not None)
            self.backend.fill_placeholders(inputs, self.last_sampled)
            return inputs

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Prepare the step and launch its forward; sample_tokens takes it from there."""
        if self.kv_connector is not None:
            self._step_finished_ids = so.finished_req_ids
            if so.kv_connector_metadata is not None:
                self.kv_connector.start_load_kv(so.kv_connector_metadata)
        inputs = self._prepare_inputs(so)
        if inputs is not None:
            self._step = self.backend.forward(inputs, so.step_id)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: object | None = None
                      ) -> ModelRunnerOutput | DeferredOutput:
        """Sample the step execute_model launched (its output may still be on the way)."""
        step = self._step
        assert step is not None, "sample_tokens without execute_model"
        self._step = None
        out = self.backend.sample(step, grammar_bitmask)
        if self.kv_connector is None:
            return out
        return _with_kv_output(out, self._kv_connector_output(idle=not step.req_ids))

    def _kv_connector_output(self, idle: bool) -> KVConnectorOutput | None:
        """Transfers finished since the last step; an idle step waits a little for one."""
        conn = self.kv_connector
        assert conn is not None
        if idle:
            conn.wait_for_transfers(0.005)
        sending, recving = conn.get_finished(self._step_finished_ids)
        out = KVConnectorOutput(sending, recving, conn.get_block_ids_with_load_errors())
        return None if out.is_empty() else out


class _KVOutputDeferred:
    """A deferred output that carries the step's KV connector report."""

    def __init__(self, inner: DeferredOutput, kv_out: KVConnectorOutput) -> None:
        self._inner, self._kv_out = inner, kv_out

    def get_output(self) -> ModelRunnerOutput:
        out = self._inner.get_output()
        out.kv_connector_output = self._kv_out
        return out

    def done(self) -> bool:
        return getattr(self._inner, "done", lambda: True)()


def _with_kv_output(out: ModelRunnerOutput | DeferredOutput, kv_out: KVConnectorOutput | None
                    ) -> ModelRunnerOutput | DeferredOutput:
    if kv_out is None:
        return out
    if isinstance(out, ModelRunnerOutput):
        out.kv_connector_output = kv_out
        return out
    return _KVOutputDeferred(out, kv_out)


def _vocab_of(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError("ModelRunner needs vocab_size for this model")
    return int(vocab)
