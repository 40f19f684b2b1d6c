"""What crosses the boundary between scheduler, worker and frontend."""

from __future__ import annotations

from dataclasses import dataclass, field

from forerun.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption), sent whole."""

    req_id: str
    prompt_token_ids: list[int]  # every known id: the prompt, plus outputs when resumed
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    resumed: bool = False


@dataclass(slots=True)
class CachedRequestData:
    """Small per-step diffs for requests the worker already holds.

    No token ids travel here: the worker feeds its own last sample into a request's next
    position, in sync and async mode alike.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: which requests run, how many tokens each, and what changed."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Set when a grammar request still has a token in flight: its bitmask for this step
    # cannot be built until that token has advanced the grammar, so sampling must wait.
    pending_structured_output_tokens: bool = False
    structured_output_request_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled ids of one step, one list per scheduled request (empty for prefill chunks)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens (and maybe the finish) of one request after one processed step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
