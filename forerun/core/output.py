"""What crosses the boundary between scheduler, worker and frontend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forerun.kv_connector.base import KVConnectorOutput
from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption), sent whole."""

    req_id: str
    prompt_token_ids: list[int]  # every known id: the prompt, plus outputs when resumed
    sampling_params: SamplingParams
    # One list per KV cache group (a tuple of one list for every model today).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # How many of prompt_token_ids are the prompt (the rest are outputs of a resumed
    # request): the worker rebuilds its penalty counts from the outputs.
    num_prompt_tokens: int = -1
    # Prompt logprobs still to compute (asked for, and not delivered before a preemption).
    want_prompt_logprobs: bool = False
    # A pooling request: the worker pools its hidden states instead of sampling.
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Small per-step diffs for requests the worker already holds.

    No token ids travel here: the worker feeds its own last sample into a request's next
    position, in sync and async mode alike.
    """

    req_ids: list[str] = field(default_factory=list)
    # Per request, the blocks appended to each KV cache group's table this step.
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


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
    # Requests whose scheduled tokens end in draft positions: how many (never which ids;
    # the worker has those). The worker may verify fewer, if its drafter found fewer.
    scheduled_spec_decode_tokens: dict[str, int] = field(default_factory=dict)
    # The KV connector's instructions for its worker half (KVConnectorMetadata), if any.
    kv_connector_metadata: Any = None


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-N alternatives.

    ``token_ids[0]`` is the token actually sampled (or, for a prompt position, the prompt
    token); ``rank`` is its 1-based rank by probability. The top-N follow in order, so the
    chosen token may appear twice.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens ``start .. start + len(entries) - 1`` (one prefill chunk)."""

    start: int
    entries: list[TokenLogprobs]


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled ids of one step, one list per scheduled request (empty for prefill chunks)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    # Requests that asked for logprobs: one entry per sampled id.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that asked for prompt logprobs and computed prompt positions this step.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: drafts verified this step per request (its sampled ids are the
    # accepted drafts plus one), and drafts the worker holds for each request's next step.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_next_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Pooling requests whose last prompt position this step computed: the pooled vector.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # The KV connector's worker half: transfers finished since the last step.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens (and maybe the finish) of one request after one processed step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new_token_ids entry
    # Every prompt position, delivered once with the first output (entry 0 is None).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's result (it comes with its finish).
    pooling_output: list[float] | None = None
    # The KV connector's request_finished answer (with the finish), if it has one.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
