"""Result objects shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position, as in vLLM."""

    logprob: float
    rank: int | None = None  # 1-based, by probability
    decoded_token: str | None = None


# One position: token id -> its Logprob (the chosen token and the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per token id, when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: its prompt and what it has generated."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    new_token_ids: list[int] = field(default_factory=list)
    # One per prompt token when asked; the first is None (nothing predicts it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
