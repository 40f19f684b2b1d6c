"""The scheduler's view of one request, with the seed's counters."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Everything above ``PREEMPTED`` is finished."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    # Holding blocks that a KV connector is filling (forerun/kv_connector/).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request as the scheduler tracks it.

    ``num_tokens`` counts the prompt plus the output tokens whose ids are *known*;
    ``num_computed_tokens`` is advanced when a step is *scheduled*; under async scheduling
    ``num_output_placeholders`` counts tokens that steps in flight will sample but whose ids
    have not arrived yet. A request needs work exactly when
    ``num_tokens + num_output_placeholders > num_computed_tokens``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.cache_salt = cache_salt
        # A KV connector's instructions (vLLM's kv_transfer_params, from extra_args).
        extra = sampling_params.extra_args or {}
        self.kv_transfer_params: dict[str, Any] | None = extra.get("kv_transfer_params")
        max_tokens = sampling_params.max_tokens
        self.max_tokens: int = max_tokens if max_tokens is not None else 1 << 30

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._output_token_ids: list[int] = []

        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        # Speculative decoding: how many drafts the next step schedules (their ids stay on
        # the worker).
        self.num_spec_tokens = 0
        # A pooling request (forerun/pooling_params.py) is prefill-only: it never samples,
        # never gets placeholders, and ends with the step that computes its last position.
        self.pooling_params = pooling_params
        self.spec_enabled = sampling_params.supports_spec_decode and pooling_params is None
        self.is_prefill_chunk = False
        # Tokens scheduled in steps whose output has not been processed yet.
        self.num_in_flight_tokens = 0
        # In-flight tokens that belonged to the request before it was preempted: their
        # output is still delivered but must not touch the reset counters.
        self.num_stale_output_tokens = 0
        self.last_sched_seq = 0
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first admission
        self.first_scheduled_time: float | None = None
        # Prompt logprobs gathered chunk by chunk (index = prompt position), handed out with
        # the first output; after that a resumed request does not compute them again.
        self.prompt_logprobs: list[Any] | None = (
            [None] * self.num_prompt_tokens
            if sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        # The grammar's compile future and matcher (forerun.structured.manager), if any.
        self.structured_output_request: Any = None

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    # ----- derived counters -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + self.num_spec_tokens

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The tokens the request will have once the steps in flight deliver their samples
        (drafts in flight counted as accepted)."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not delivered yet (they need the whole prefill)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def skips_prefix_cache(self) -> bool:
        """Cached positions would not be computed, and this request needs them: prompt
        logprobs, or pooling that reads every position (MEAN, CLS)."""
        return self.wants_prompt_logprobs or (
            self.pooling_params is not None and self.pooling_params.needs_every_position)

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"num_output_placeholders={self.num_output_placeholders})"
        )
