"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request runs as the chat completion it amounts to (anthropic_protocol.py maps
the body), through the same template, tool planning and engine calls as
``/v1/chat/completions``; this module shapes the answer as Anthropic's ``message`` object,
or its stream of events (``message_start`` ... ``message_stop``), and every error as
``{"type": "error", "error": {"type": ..., "message": ...}}``.

With ``--reasoning-parser`` the model's thinking is a ``thinking`` block (``signature`` "":
there is nothing to sign) before the answer's blocks, streamed as ``thinking_delta``s while
the model thinks; tool calls are read from the answer only. ``thinking: {"type":
"disabled"}`` leaves it out (and tells an ``enable_thinking`` template).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from forerun.engine.async_llm import EngineOverloadedError, RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import RequestOutput
from forerun.server.anthropic_protocol import (
    AnthropicChatRequest,
    CountTokensRequest,
    MessagesRequest,
    validation_message,
)
from forerun.server.bodies import encode
from forerun.server.chat import chat_prompt_ids
from forerun.server.edge import (
    ClientDisconnected,
    off_loop_if_big,
    read_body,
    set_error_shape,
    unless_disconnected,
)
from forerun.server.errors import (
    APIError,
    engine_dead_error,
    overloaded_error,
    param_of,
    timeout_error,
)
from forerun.server.reasoning import (
    ChoiceReasoningStream,
    ReasoningPlan,
    plan_reasoning,
    thinking_fields,
)
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    request_ids,
    start_requests,
)
from forerun.server.tool_calls import ToolPlan, plan_tools, tool_message

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"

# Anthropic's error type for each status it uses; any other 5xx is an api_error.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorEnvelope(msgspec.Struct):
    error: ErrorDetail
    type: str = "error"


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str
    citations: None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class MessageUsage(msgspec.Struct):
    """Anthropic's usage: ``input_tokens`` are the prompt tokens the prefix cache did not
    hold, ``cache_read_input_tokens`` those it did (the two add up to the prompt). Nothing
    is billed for adding blocks to the cache, so cache_creation_input_tokens is 0."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(msgspec.Struct):
    """Anthropic's ``message`` object."""

    id: str
    model: str
    content: list[ContentBlock]
    usage: MessageUsage
    stop_reason: str | None = None
    stop_sequence: str | None = None
    role: str = "assistant"
    type: str = "message"


def anthropic_error(err: APIError) -> Response:
    """``err`` as Anthropic's error body, its type named for its status."""
    kind = _ERROR_TYPES.get(err.status,
                            "api_error" if err.status >= 500 else "invalid_request_error")
    body = ErrorEnvelope(ErrorDetail(kind, err.message))
    return Response(encode(body), status_code=err.status, media_type="application/json",
                    headers=err.headers)


def _event(kind: str, **fields: Any) -> bytes:
    """One SSE event with its ``event:`` line, as Anthropic sends them."""
    return b"event: " + kind.encode() + b"\ndata: " + encode({"type": kind, **fields}) + b"\n\n"


def _usage(out: RequestOutput | None, n_prompt: int, n_gen: int) -> MessageUsage:
    cached = out.num_cached_tokens if out is not None else 0
    return MessageUsage(n_prompt - cached, n_gen, cached)


def _blocks(plan: ToolPlan, text: str, finish: str | None,
            rplan: ReasoningPlan | None = None) -> list[ContentBlock]:
    """A finished generation's content: its thinking (with a reasoning parser), its text,
    then its tool calls (a call whose input is not a JSON object, cut short by max_tokens,
    stays text)."""
    blocks: list[ContentBlock] = []
    answer = text
    if rplan is not None:  # the split first: tool calls come from the answer only
        reasoning, answer = rplan.split_whole(text)
        if reasoning and rplan.include:
            blocks.append(ThinkingBlock(reasoning))
    if plan.mode == "none":
        return blocks + ([TextBlock(answer)] if answer else [])
    # harmony's tool parser reads the whole text and skips the thinking itself
    message, _ = tool_message(plan, "assistant", text if plan.reads_whole_output else answer,
                              finish)
    if message.content:
        blocks.append(TextBlock(message.content))
    for call in message.tool_calls:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            args = None
        if isinstance(args, dict):
            blocks.append(ToolUseBlock(f"toolu_{uuid.uuid4().hex[:24]}", call.function.name,
                                       args))
        else:
            blocks.append(TextBlock(call.function.arguments))
    return blocks


def _stop(blocks: list[ContentBlock], finish: str | None,
          stop_reason: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the engine's finish."""
    if finish == "length":
        return "max_tokens", None
    if finish == "error":
        raise APIError(500, "the engine failed while generating", "InternalServerError")
    if any(isinstance(b, ToolUseBlock) for b in blocks):
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _renamed(err: APIError) -> APIError:
    """An error raised by the chat machinery, naming the Anthropic field instead."""
    # A Messages body has no response_format: one named is output_config.format.
    err.message = AnthropicChatRequest.api_error_text(err.message).replace(
        "response_format", "output_config.format")
    if err.param in AnthropicChatRequest.engine_field_names:
        err.param = AnthropicChatRequest.engine_field_names[err.param]
    if err.param and not err.message.startswith(err.param):
        # Anthropic's body has no param: the message itself names the field.
        err.message = f"{err.param}: {err.message}"
    return err


def _parse(model: type[BaseModel], raw: bytes, reasoning: bool = False) -> Any:
    """The body; ``reasoning``: the server has a reasoning parser (``thinking`` allowed)."""
    try:
        return model.model_validate_json(raw, context={"reasoning": reasoning})
    except ValidationError as exc:
        msg = validation_message(exc)
        raise APIError(400, msg, "invalid_request_error", param_of(msg)) from None


class _Plan:
    """A Messages request checked and mapped: its chat form, tool and reasoning plans and
    prompt ids."""

    def __init__(self, ctx: ServingContext, body: MessagesRequest) -> None:
        check_model(ctx, body.model)
        try:
            chat = body.to_chat(_thinking_chat_fields(ctx, body))
        except ValueError as exc:
            raise APIError.bad_request(str(exc)) from None
        self.plan = plan_tools(ctx.tool_config, chat, ctx.engine.tokenizer)
        self.ids = chat_prompt_ids(ctx, chat, self.plan)
        self.chat = self.plan.adjust_request(chat)
        self.rplan = plan_reasoning(ctx.reasoning_parser, self.chat, ctx.engine.tokenizer,
                                    ctx.structured_enable_in_reasoning)
        if self.rplan is not None:  # output_config.format (and forced calls) after it
            self.chat = self.rplan.adjust_request(self.chat,
                                                  forced_calls=self.plan.schema is not None)


def _thinking_chat_fields(ctx: ServingContext,
                          body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat fields ``thinking`` sets (none without a reasoning parser)."""
    if ctx.reasoning_parser is None:
        return {}
    return thinking_fields(ctx, body.thinking_switch())


async def create_message(ctx: ServingContext, body: MessagesRequest, request: Request,
                         body_bytes: int = 0) -> Response:
    rid, engine_id = request_ids(request, "msg", "_")
    try:
        p = await off_loop_if_big(body_bytes, _Plan, ctx, body)
        streams = await start_requests(ctx, p.chat, engine_id, [{"prompt_token_ids": p.ids}],
                                       p.chat.requested_max_tokens, None, body_bytes)
    except APIError as err:
        raise _renamed(err) from None
    if body.stream:
        return StreamingResponse(_stream(ctx, rid, streams[0], p.plan, p.rplan),
                                 media_type="text/event-stream")
    (out,) = await unless_disconnected(request, final_outputs(streams))
    (c,) = out.outputs
    blocks = _blocks(p.plan, c.text, c.finish_reason, p.rplan)
    stop, seq = _stop(blocks, c.finish_reason, c.stop_reason)
    msg = Message(rid, ctx.model_name, blocks,
                  _usage(out, len(out.prompt_token_ids), len(c.token_ids)), stop, seq)
    return Response(encode(msg), media_type="application/json")


async def _stream(ctx: ServingContext, rid: str, stream: RequestStream, plan: ToolPlan,
                  rplan: ReasoningPlan | None = None) -> AsyncIterator[bytes]:
    """Anthropic's events. Thinking and plain text are sent as they come, each kind in its
    own block (a new block whenever the kind changes); with tools the answer is parsed
    whole at the end and its blocks sent then (a tool_use block as one input_json_delta)."""
    live = plan.mode == "none"
    thinking = ChoiceReasoningStream(rplan) if rplan is not None else None
    n_prompt = len(stream.prompt_token_ids)
    started = False
    index, open_kind = -1, ""  # the block being streamed: its index and kind ("": none)
    sent, text, finish, stop_reason, n_gen = 0, "", None, None, 0
    streamed: list[ContentBlock] = []
    out: RequestOutput | None = None
    try:
        async for out in stream:
            if not started:  # after the first output, which knows the prefix cache's share
                started = True
                yield _event("message_start", message=Message(
                    rid, ctx.model_name, [], _usage(out, n_prompt, 0)))
                yield _event("ping")
            (c,) = out.outputs
            text, finish, stop_reason, n_gen = c.text, c.finish_reason, c.stop_reason, \
                len(c.token_ids)
            if thinking is not None:
                d = thinking.step(text, finish is not None)
                pieces = [("thinking", d.reasoning), ("text", d.content)]
            else:
                pieces = [("text", text[sent:])]
                sent = len(text)
            for kind, piece in pieces:
                if not piece or (kind == "text" and not live):
                    continue
                if kind != open_kind:
                    if open_kind:
                        yield _event("content_block_stop", index=index)
                    index, open_kind = index + 1, kind
                    streamed.append(ThinkingBlock("") if kind == "thinking" else TextBlock(""))
                    yield _event("content_block_start", index=index,
                                 content_block=streamed[-1])
                if kind == "thinking":
                    delta = {"type": "thinking_delta", "thinking": piece}
                else:
                    delta = {"type": "text_delta", "text": piece}
                yield _event("content_block_delta", index=index, delta=delta)
        if not started:
            yield _event("message_start", message=Message(
                rid, ctx.model_name, [], _usage(out, n_prompt, 0)))
        if open_kind:
            yield _event("content_block_stop", index=index)
        blocks = streamed
        if not live:
            blocks = [b for b in _blocks(plan, text, finish, rplan)
                      if not isinstance(b, ThinkingBlock)]  # the thinking went out live
            for i, block in enumerate(blocks, start=index + 1):
                for chunk in _whole_block(i, block):
                    yield chunk
        stop, seq = _stop(blocks, finish, stop_reason)
        usage = _usage(out, n_prompt, n_gen)
        yield _event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                     usage=usage)
        yield _event("message_stop")
    except (EngineDeadError, RequestTimeoutError, APIError) as exc:
        err = exc if isinstance(exc, APIError) else (
            engine_dead_error(exc) if isinstance(exc, EngineDeadError) else timeout_error(exc))
        status = 500 if err.status < 500 else err.status
        kind = _ERROR_TYPES.get(status, "api_error")
        yield _event("error", error=ErrorDetail(kind, err.message))
    finally:
        stream.abort()


def _whole_block(index: int, block: ContentBlock) -> list[bytes]:
    """A finished block's events, as a live one would have sent them."""
    if isinstance(block, TextBlock):
        start: ContentBlock = TextBlock("")
        delta = {"type": "text_delta", "text": block.text}
    else:
        start = ToolUseBlock(block.id, block.name, {})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block.input)}
    return [_event("content_block_start", index=index, content_block=start),
            _event("content_block_delta", index=index, delta=delta),
            _event("content_block_stop", index=index)]


def count_tokens(ctx: ServingContext, body: CountTokensRequest) -> dict[str, int]:
    """``{"input_tokens": N}``: the conversation's prompt through the chat template, tools
    included, as /v1/messages would run it."""
    check_model(ctx, body.model)
    try:
        chat = body.to_chat(_thinking_chat_fields(ctx, body))
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    try:
        ids = chat_prompt_ids(ctx, chat, ToolPlan(chat.tools, "none"))
    except APIError as err:
        raise _renamed(err) from None
    return {"input_tokens": len(ids)}


def register_anthropic_routes(app: FastAPI, ctx: ServingContext, max_body_bytes: int) -> None:
    """Add ``/v1/messages`` and ``/v1/messages/count_tokens`` to ``app``; errors on them
    (the edge's 401 and 413 included) take Anthropic's shape."""
    set_error_shape(app, MESSAGES_PATH, anthropic_error)

    async def answer(request: Request,
                     handle: Callable[[bytes], Awaitable[Response]]) -> Response:
        try:
            raw = await read_body(request, max_body_bytes)
            return await handle(raw)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it
        except APIError as err:
            return anthropic_error(err)
        except EngineDeadError as exc:
            return anthropic_error(engine_dead_error(exc))
        except EngineOverloadedError as exc:
            err = overloaded_error(exc)
            err.status = 529  # Anthropic's status for "overloaded, retry later"
            return anthropic_error(err)
        except RequestTimeoutError as exc:
            return anthropic_error(timeout_error(exc))
        except Exception as exc:  # noqa: BLE001 - answered in the API's shape, and logged
            logger.exception("unhandled error")
            return anthropic_error(APIError(500, f"internal error: {exc}"))

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        async def handle(raw: bytes) -> Response:
            body = await off_loop_if_big(len(raw), _parse, MessagesRequest, raw,
                                        ctx.reasoning_parser is not None)
            return await create_message(ctx, body, request, len(raw))
        return await answer(request, handle)

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        async def handle(raw: bytes) -> Response:
            body = await off_loop_if_big(len(raw), _parse, CountTokensRequest, raw,
                                        ctx.reasoning_parser is not None)
            counted = await off_loop_if_big(len(raw), count_tokens, ctx, body)
            return Response(encode(counted), media_type="application/json")
        return await answer(request, handle)
