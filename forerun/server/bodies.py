"""OpenAI response bodies as msgspec Structs, encoded straight to JSON."""

from __future__ import annotations

from typing import Any

import msgspec

UNSET = msgspec.UNSET


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's breakdowns, which forerun does not report: null, as vLLM's prompt one is,
    # so the object a client parses holds the same keys as the JSON.
    prompt_tokens_details: None = None
    completion_tokens_details: None = None

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
    """A completion choice, whole or a stream chunk's; vLLM's extras are null unless asked
    for (clients read them unconditionally). A stream chunk has no ``prompt_logprobs``
    (UNSET) and sends ``prompt_token_ids`` in each choice's first chunk only."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the choice (null for EOS or length).
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None | msgspec.UnsetType = None
    prompt_token_ids: list[int] | None = None


class Completion(msgspec.Struct):
    """Body of a non-streamed ``/v1/completions`` answer, and of each stream chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | msgspec.UnsetType = UNSET
    system_fingerprint: None = None
    # vLLM's: a KV connector's answer (a prefill instance's says where its KV is).
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType = UNSET


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
    # With --reasoning-parser only (UNSET fields are never encoded): vLLM's current name
    # and the one it had before, which clients still read; both hold the same text.
    reasoning: str | None | msgspec.UnsetType = UNSET
    reasoning_content: str | None | msgspec.UnsetType = UNSET
    # OpenAI's message fields forerun never fills: null, so a parsed message equals it.
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    # Always present, empty without calls.
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
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM puts these on the response, not the choice (the prompt is shared by all); null
    # unless asked for, as are OpenAI's fields forerun does not produce.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    service_tier: None = None
    system_fingerprint: None = None
    metadata: None = None
    moderation: None = None
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType = UNSET


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
    reasoning: str | msgspec.UnsetType = UNSET  # both names, as on ChatMessage
    reasoning_content: str | msgspec.UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | msgspec.UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | msgspec.UnsetType = UNSET  # this chunk's, with return_token_ids
    stop_reason: int | str | None | msgspec.UnsetType = UNSET  # on the finishing chunk


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
