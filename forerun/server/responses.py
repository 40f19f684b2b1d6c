"""OpenAI response bodies as msgspec Structs, encoded straight to JSON."""

from __future__ import annotations

import msgspec

UNSET = msgspec.UNSET


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions ``logprobs`` object: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct):
    """Body of a non-streamed ``/v1/completions`` answer, and of each stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | msgspec.UnsetType = UNSET


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | msgspec.UnsetType = UNSET
    content: str | msgspec.UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = UNSET


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "forerun"
    root: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


def encode(obj: object) -> bytes:
    return msgspec.json.encode(obj)


def sse(obj: object) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
