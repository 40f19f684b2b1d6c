"""One pipeline stage's step: the model's step with the stage's sends and receives around it.

The wire protocol (what goes stage to stage, the output back to the first) is
forerun/worker/pipeline.py; this is where a stage's runner uses it. Only the first stage
feeds sampled ids into its input, and they come from the last stage, so it waits for the
outputs that hold the ones it feeds; only the last stage has logits and samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forerun.core.output import ModelRunnerOutput
from forerun.trace import WORKER_LANE
from forerun.worker.model_step import ModelStep
from forerun.worker.output_plan import DeferredOutput, make_output
from forerun.worker.step_backend import StepState
from forerun.worker.step_inputs import StepInputs

if TYPE_CHECKING:  # for the annotation only: a runner without a pipeline never loads it
    from forerun.worker.pipeline import PipelineComm


class PipelineStage:
    """The :class:`~forerun.worker.step_backend.StepBackend` of one stage of a pipeline."""

    def __init__(self, comm: PipelineComm, inner: ModelStep) -> None:
        self.comm = comm
        self.inner = inner

    def fill_placeholders(self, inputs: StepInputs, last_sampled: torch.Tensor) -> None:
        holes = inputs.placeholders
        if not holes.rows or not self.comm.is_first:  # the ids are the first stage's input only
            return
        # The samples come from the last stage: wait for the ones fed here.
        self.comm.apply_outputs(last_sampled, set(holes.req_ids))
        holes.fill(inputs.input_ids, last_sampled)

    def forward(self, inputs: StepInputs, step_id: int) -> StepState:
        """This stage's share of the forward; the last stage's logits, or (after sending
        this stage's intermediate on) a step with none."""
        pp, inner = self.comm, self.inner
        with inner.tracer.span("forward", WORKER_LANE, step_id):
            intermediate = None if pp.is_first else pp.recv_intermediate(len(inputs.input_ids))
            out = inner.model(inputs.input_ids, inputs.positions, inner.kv_caches, inputs.meta,
                              intermediate)
            if pp.is_last:
                return inner.finish_forward(inputs, out, step_id)
            pp.send_intermediate(out)
            return StepState(list(inputs.num_tokens_of), inputs.sample_req_ids,
                             inputs.sample_slots, None, step_id)

    def sample(self, step: StepState, grammar_bitmask: object | None
               ) -> ModelRunnerOutput | DeferredOutput:
        """The last stage samples and sends the output to the first, which returns a handle
        on it at once; a middle stage returns an empty output."""
        pp = self.comm
        if not pp.is_last:
            if not pp.is_first:
                return make_output(step.req_ids, [], [])
            slots = step.sample_slots.tolist() if step.sample_slots is not None else []
            return pp.expect_output(step.sample_req_ids, slots)
        out = self.inner.sample(step, grammar_bitmask)
        if not isinstance(out, ModelRunnerOutput):
            out = out.get_output()
        pp.send_output(out)
        return out
