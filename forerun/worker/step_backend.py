"""The device half of a step, behind one interface, and what it hands from forward to sampling.

:class:`~forerun.worker.model_runner.ModelRunner` does a step's host work itself (request
state, flat inputs) and leaves the rest to a :class:`StepBackend`: the local model
(:class:`~forerun.worker.model_step.ModelStep`), one pipeline stage around it
(:class:`~forerun.worker.pipeline_stage.PipelineStage`) or a simulated device
(:class:`~forerun.worker.simulated.SimulatedDevice`). A new way to run a step is a new
backend, not another branch in the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from forerun.core.output import ModelRunnerOutput
from forerun.worker.output_plan import DeferredOutput
from forerun.worker.prompt_logprobs import PromptLogprobsChunk
from forerun.worker.step_inputs import StepInputs


@dataclass(slots=True)
class StepState:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]
    sample_req_ids: list[str]
    sample_slots: torch.Tensor | None
    logits: torch.Tensor | None
    step_id: int
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    # With a drafter: each sampling request's drafts verified this step (its logits rows
    # are len(drafts) + 1 consecutive rows).
    drafts: list[list[int]] | None = None
    # Pooling requests that ended their prompt this step: (req_id, pooled vector on the
    # device, float32).
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class StepBackend(Protocol):
    """Runs the device part of a step: fills its placeholders, runs its forward, samples.

    Calls come in step order, each ``forward`` followed by its ``sample``; a step that
    schedules nothing gets no ``forward`` (and no ``fill_placeholders``), only a ``sample``
    of an empty :class:`StepState`.
    """

    def fill_placeholders(self, inputs: StepInputs, last_sampled: torch.Tensor) -> None:
        """Write the previous samples into ``inputs.input_ids`` (see step_inputs)."""
        ...

    def forward(self, inputs: StepInputs, step_id: int) -> StepState:
        """Launch the step's forward; what sampling needs comes back."""
        ...

    def sample(self, step: StepState, grammar_bitmask: object | None
               ) -> ModelRunnerOutput | DeferredOutput:
        """Sample the step; the output may still be on its way to the host."""
        ...
