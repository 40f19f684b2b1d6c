"""A step's output on its way to the host: which device tensors, how to read them, the copy.

Sampled ids (and logprobs) are device tensors when sampling returns. :class:`OutputPlan`
lists them and knows how to turn their host values into a ``ModelRunnerOutput``;
:class:`HostCopy` copies them on a side stream (CUDA) and hands back an
:class:`AsyncModelRunnerOutput` at once, so the worker starts the next step without a
device-to-host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from forerun.core.output import ModelRunnerOutput, PromptLogprobs, TokenLogprobs
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import SamplerOutput

if TYPE_CHECKING:
    from forerun.worker.step_backend import StepState


class DeferredOutput(Protocol):
    """A step's output that is not on the host yet; ``get_output`` waits for it."""

    def get_output(self) -> ModelRunnerOutput: ...


class AsyncModelRunnerOutput:
    """Sampled ids (and logprobs) still being copied device -> host.

    The worker returns this at once so that it can start the next step without a
    device-to-host sync; only the engine, when it needs the ids, waits on the event.
    """

    def __init__(self, host: list[torch.Tensor], event: torch.cuda.Event,
                 build: Callable[[list[list]], ModelRunnerOutput]) -> None:
        self._host, self._event, self._build = host, event, build

    def get_output(self) -> ModelRunnerOutput:
        self._event.synchronize()
        return self._build([t.tolist() for t in self._host])


def make_output(req_ids: list[str], sample_req_ids: list[str], ids: list[int]
                ) -> ModelRunnerOutput:
    """The output of a step over ``req_ids`` where ``sample_req_ids`` sampled one id each."""
    sampled: dict[str, list[int]] = {r: [t] for r, t in zip(sample_req_ids, ids, strict=True)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
    )


@dataclass(slots=True)
class OutputPlan:
    """Which device tensors one step returns, and how to read them on the host."""

    req_ids: list[str]
    sample_req_ids: list[str]
    logprob_rows: list[tuple[str, int, int]]  # (req_id, row, top-N) of rows that asked
    prompt_reqs: list[tuple[str, int]]  # (req_id, start position) of prompt chunks
    tensors: list[torch.Tensor]
    pool_reqs: list[str] = field(default_factory=list)  # pooled vectors, after the rest

    @classmethod
    def of(cls, step: StepState, out: SamplerOutput | None,
           requests: dict[str, CachedRequestState], device: torch.device) -> OutputPlan:
        """The plan for ``step``; ``out`` is its sample (None: it sampled nothing here)."""
        tensors: list[torch.Tensor] = []
        rows: list[tuple[str, int, int]] = []
        sample_req_ids = step.sample_req_ids if out is not None else []
        if out is not None:
            tensors.append(out.sampled)
            if out.logprob_ids is not None:
                assert out.logprobs is not None and out.ranks is not None
                for row, req_id in enumerate(step.sample_req_ids):
                    n = requests[req_id].sampling_params.logprobs
                    if n is not None:
                        rows.append((req_id, row, n))
                tensors += [out.logprob_ids, out.logprobs, out.ranks]
        else:
            tensors.append(torch.zeros(0, dtype=torch.long, device=device))
        prompt_reqs: list[tuple[str, int]] = []
        for chunk in step.prompt_logprobs:
            prompt_reqs.append((chunk.req_id, chunk.start))
            tensors += [chunk.ids, chunk.logprobs, chunk.ranks]
        pool_reqs = [req_id for req_id, _ in step.pooled]
        tensors += [vec for _, vec in step.pooled]
        return cls(step.req_ids, sample_req_ids, rows, prompt_reqs, tensors, pool_reqs)

    def build(self, host: list[list]) -> ModelRunnerOutput:
        """The output from the host values of ``tensors``, in the same order."""
        out = make_output(self.req_ids, self.sample_req_ids, host[0])
        i = 1
        if self.logprob_rows:
            ids, vals, ranks = host[1], host[2], host[3]
            i = 4
            for req_id, row, n in self.logprob_rows:
                out.logprobs[req_id] = [
                    TokenLogprobs(ids[row][: n + 1], vals[row][: n + 1], ranks[row])]
        for req_id, start in self.prompt_reqs:
            ids, vals, ranks = host[i], host[i + 1], host[i + 2]
            i += 3
            out.prompt_logprobs[req_id] = PromptLogprobs(
                start, [TokenLogprobs(a, b, r) for a, b, r in zip(ids, vals, ranks, strict=True)])
        for req_id in self.pool_reqs:
            out.pooler_output[req_id] = host[i]
            i += 1
        return out

    def build_now(self) -> ModelRunnerOutput:
        """The output, read from the device synchronously."""
        return self.build([t.tolist() for t in self.tensors])


class HostCopy:
    """Copies a plan's tensors to the host: at once on a CPU device, on a side stream of
    its own on CUDA (so the copy overlaps the next step's launch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, plan: OutputPlan) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if self._stream is None:
            return plan.build_now()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = []
            for t in plan.tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                # The sampler's tensors must outlive the copy, not just this call.
                t.record_stream(stream)
                host.append(h)
            event = torch.cuda.Event()
            event.record(stream)
        return AsyncModelRunnerOutput(host, event, plan.build)
