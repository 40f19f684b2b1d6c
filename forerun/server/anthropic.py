"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request runs as the chat completion it amounts to (anthropic_protocol.py maps
the body), through the same template, tool planning and engine calls as
``/v1/chat/completions``; this module shapes the answer as Anthropic's ``message`` object,
or its stream of events (``message_start`` ... ``message_stop``), and every error as
``{"type": "error", "error": {"type": ..., "message": ...}}``.
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


ContentBlock = TextBlock | ToolUseBlock


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


def _blocks(plan: ToolPlan, text: str, finish: str | None) -> list[ContentBlock]:
    """A finished generation's content: its text, then its tool calls (a call whose input
    is not a JSON object, cut short by max_tokens, stays text)."""
    if plan.mode == "none":
        return [TextBlock(text)] if text else []
    message, _ = tool_message(plan, "assistant", text, finish)
    blocks: list[ContentBlock] = [TextBlock(message.content)] if message.content else []
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


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        msg = validation_message(exc)
        raise APIError(400, msg, "invalid_request_error", param_of(msg)) from None


class _Plan:
    """A Messages request checked and mapped: its chat form, tool plan and prompt ids."""

    def __init__(self, ctx: ServingContext, body: MessagesRequest) -> None:
        check_model(ctx, body.model)
        try:
            chat = body.to_chat()
        except ValueError as exc:
            raise APIError.bad_request(str(exc)) from None
        self.plan = plan_tools(ctx.tool_config, chat, ctx.engine.tokenizer)
        self.ids = chat_prompt_ids(ctx, chat, self.plan)
        self.chat = self.plan.adjust_request(chat)


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
        return StreamingResponse(_stream(ctx, rid, streams[0], p.plan),
                                 media_type="text/event-stream")
    (out,) = await unless_disconnected(request, final_outputs(streams))
    (c,) = out.outputs
    blocks = _blocks(p.plan, c.text, c.finish_reason)
    stop, seq = _stop(blocks, c.finish_reason, c.stop_reason)
    msg = Message(rid, ctx.model_name, blocks,
                  _usage(out, len(out.prompt_token_ids), len(c.token_ids)), stop, seq)
    return Response(encode(msg), media_type="application/json")


async def _stream(ctx: ServingContext, rid: str, stream: RequestStream,
                  plan: ToolPlan) -> AsyncIterator[bytes]:
    """Anthropic's events. Plain text is sent as it comes; with tools the output is parsed
    whole at the end and its blocks sent then (a tool_use block as one input_json_delta)."""
    live = plan.mode == "none"
    n_prompt = len(stream.prompt_token_ids)
    started = block_open = False
    sent, text, finish, stop_reason, n_gen = 0, "", None, None, 0
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
            if live and len(text) > sent:
                if not block_open:
                    block_open = True
                    yield _event("content_block_start", index=0,
                                 content_block=TextBlock(""))
                yield _event("content_block_delta", index=0,
                             delta={"type": "text_delta", "text": text[sent:]})
                sent = len(text)
        if not started:
            yield _event("message_start", message=Message(
                rid, ctx.model_name, [], _usage(out, n_prompt, 0)))
        if live:
            blocks: list[ContentBlock] = [TextBlock(text)] if block_open else []
            if block_open:
                yield _event("content_block_stop", index=0)
        else:
            blocks = _blocks(plan, text, finish)
            for i, block in enumerate(blocks):
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
        chat = body.to_chat()
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
            body = await off_loop_if_big(len(raw), _parse, MessagesRequest, raw)
            return await create_message(ctx, body, request, len(raw))
        return await answer(request, handle)

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        async def handle(raw: bytes) -> Response:
            body = await off_loop_if_big(len(raw), _parse, CountTokensRequest, raw)
            counted = await off_loop_if_big(len(raw), count_tokens, ctx, body)
            return Response(encode(counted), media_type="application/json")
        return await answer(request, handle)
