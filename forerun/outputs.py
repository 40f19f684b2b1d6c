"""Result objects shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    # A KV connector's answer for the finished request (a prefill/decode producer's says
    # where its KV can be read); None otherwise.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's ``PoolingOutput``; a list here, not a tensor)."""

    data: list[float]


@dataclass(slots=True)
class PoolingRequestOutput:
    """A finished pooling request (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    # "stop" when the vector is there; "abort" / "error" when there is none.
    finish_reason: str | None = None
    prompt: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(out.outputs.data), out.prompt_token_ids,
                   out.finished)


@dataclass(slots=True)
class ScoringOutput:
    """The similarity of one text pair (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's shape): both prompts' ids, one score."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
