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


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's ``prompt_logprobs``: a candidate token at a prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's ``prompt_logprobs``: one per prompt token, None for the first (nothing predicts
# it), else token id (a JSON key, so a string) -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extras, left out of the JSON unless asked for (return_token_ids,
    # prompt_logprobs); a stream sends prompt_token_ids in each choice's first chunk only.
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = UNSET
    token_ids: list[int] | msgspec.UnsetType = UNSET


class Completion(msgspec.Struct):
    """Body of a non-streamed ``/v1/completions`` answer, and of each stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | msgspec.UnsetType = UNSET


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | None
    # Always present, empty without calls, as vLLM sends it.
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


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
    token_ids: list[int] | msgspec.UnsetType = UNSET  # with return_token_ids


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM puts these on the response, not the choice (the prompt is shared by all).
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = UNSET


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | msgspec.UnsetType = UNSET
    arguments: str | msgspec.UnsetType = UNSET


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A streamed call's piece: id, type and name come once, then argument fragments."""

    index: int
    id: str | msgspec.UnsetType = UNSET
    type: str | msgspec.UnsetType = UNSET
    function: DeltaFunctionCall | msgspec.UnsetType = UNSET


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | msgspec.UnsetType = UNSET
    content: str | msgspec.UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | msgspec.UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | msgspec.UnsetType = UNSET  # this chunk's, with return_token_ids


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = UNSET  # first chunk only


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
