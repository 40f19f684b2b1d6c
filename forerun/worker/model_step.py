"""A step on the model held here: the forward over the paged KV cache, its logits, sampling."""

from __future__ import annotations

import torch

from forerun.core.output import ModelRunnerOutput
from forerun.model.attention import KVCache
from forerun.trace import WORKER_LANE, Tracer
from forerun.worker.grammar_bitmask import apply_grammar_bitmask
from forerun.worker.output_plan import AsyncModelRunnerOutput, HostCopy, OutputPlan, make_output
from forerun.worker.pooler import Pooler
from forerun.worker.prompt_logprobs import prompt_logprobs
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import Sampler
from forerun.worker.sampling_state import SamplingState
from forerun.worker.spec_step import SpecDecodeStep
from forerun.worker.step_backend import StepState
from forerun.worker.step_inputs import StepInputs


class ModelStep:
    """The :class:`~forerun.worker.step_backend.StepBackend` of a runner that holds the
    whole model: forward, logits of the sampled rows (and of the prompt-logprob rows),
    sampling, and the sampled ids kept on the device in ``last_sampled``."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache],
                 requests: dict[str, CachedRequestState], last_sampled: torch.Tensor,
                 sampler: Sampler, sampling_state: SamplingState,
                 spec: SpecDecodeStep | None, tracer: Tracer, device: torch.device,
                 pooler: Pooler | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.requests = requests
        self.last_sampled = last_sampled
        self.sampler = sampler
        self.sampling_state = sampling_state
        self.spec = spec
        self.tracer = tracer
        self.device = device
        self.host_copy = HostCopy(device)
        self.pooler = pooler if pooler is not None else Pooler()

    def fill_placeholders(self, inputs: StepInputs, last_sampled: torch.Tensor) -> None:
        inputs.placeholders.fill(inputs.input_ids, last_sampled)

    def forward(self, inputs: StepInputs, step_id: int) -> StepState:
        with self.tracer.span("forward", WORKER_LANE, step_id):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.meta)
            return self.finish_forward(inputs, hidden, step_id)

    def finish_forward(self, inputs: StepInputs, hidden: torch.Tensor, step_id: int
                       ) -> StepState:
        """What sampling needs from the last layer's hidden states: the logits of the rows
        that sample, the prompt logprobs of the chunks that asked, and the vectors of the
        pooling requests whose prompt ended."""
        logits = (self.model.compute_logits(hidden[inputs.logits_rows])
                  if inputs.sample_req_ids else None)
        prompt_lps = prompt_logprobs(self.model, self.requests, inputs.num_tokens_of, hidden,
                                     self.device)
        pooled = (self.pooler(hidden, inputs.pool_chunks, self.requests)
                  if inputs.pool_chunks else [])
        return StepState(list(inputs.num_tokens_of), inputs.sample_req_ids,
                         inputs.sample_slots, logits, step_id, prompt_lps, inputs.drafts,
                         pooled)

    def sample(self, step: StepState, grammar_bitmask: object | None
               ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if step.logits is None:
            plan = OutputPlan.of(step, None, self.requests, self.device)
            if not plan.prompt_reqs and not plan.pool_reqs:
                return make_output(step.req_ids, [], [])
            return self.host_copy.start(plan)
        with self.tracer.span("sample", WORKER_LANE, step.step_id):
            if step.drafts is not None:
                assert self.spec is not None
                return self.spec.sample(step, grammar_bitmask, self.requests)
            return self._sample(step, step.logits, grammar_bitmask)

    def _sample(self, step: StepState, logits: torch.Tensor, grammar_bitmask: object | None
                ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """One token per sampling request; the ids stay on the device for the next step."""
        if grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, step.sample_req_ids, grammar_bitmask)
        states = [self.requests[r] for r in step.sample_req_ids]
        out = self.sampler(logits, self.sampling_state.metadata(states))
        # The next step reads these on the device; no host round trip.
        self.last_sampled[step.sample_slots] = out.sampled
        self.sampling_state.record_samples(states, out.sampled)
        return self.host_copy.start(OutputPlan.of(step, out, self.requests, self.device))
