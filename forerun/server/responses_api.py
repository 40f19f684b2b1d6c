"""``POST /v1/responses``: OpenAI's Responses API, run as the chat completion it amounts to.

Non-streamed, the answer is a ``response`` object whose ``output`` holds a ``message``
item (``output_text`` content) and, with tools, ``function_call`` items. Streamed, it is
OpenAI's event sequence (``response.created`` ... ``response.completed``), each event with
a ``sequence_number``. As in vLLM, a response cut by ``max_output_tokens`` ends with
``response.completed`` carrying ``status: "incomplete"``. Nothing is stored.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import RequestOutput
from forerun.server.bodies import encode
from forerun.server.chat import chat_prompt_ids
from forerun.server.edge import off_loop_if_big, unless_disconnected
from forerun.server.errors import APIError, engine_dead_error, timeout_error
from forerun.server.logprobs import chat_logprobs
from forerun.server.responses_protocol import ResponsesChatRequest, ResponsesRequest
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    now_s,
    request_ids,
    start_requests,
)
from forerun.server.tool_calls import ToolPlan, plan_tools, tool_message

logger = logging.getLogger(__name__)


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class MessageItem(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"
    type: str = "message"


class FunctionCallItem(msgspec.Struct):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    # Prompt tokens this request added to the prefix cache: its full blocks not found
    # there already (prefix caching keeps whole blocks only).
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class ResponseError(msgspec.Struct):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct):
    """OpenAI's ``response`` object, with the request's settings echoed."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[MessageItem | FunctionCallItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    instructions: str | None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    previous_response_id: None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    user: str | None = None
    store: bool = False
    truncation: str = "disabled"
    background: bool = False
    object: str = "response"


def _item_id(prefix: str) -> str:
    """An output item's id, spelled as OpenAI's (``msg_...``, ``fc_...``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _event(seq: int, kind: str, **fields: Any) -> bytes:
    """One SSE event: ``event: <type>`` and its JSON, as OpenAI and vLLM send them."""
    data = encode({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class _Run:
    """One response in the making: the request, its id and what its object echoes."""

    def __init__(self, ctx: ServingContext, body: ResponsesRequest, rid: str,
                 created: int) -> None:
        self.ctx, self.body, self.rid, self.created = ctx, body, rid, created

    def response(self, status: str, output: list[MessageItem | FunctionCallItem],
                 out: RequestOutput | None = None, n_gen: int = 0) -> ResponseObject:
        body = self.body
        usage = None
        if out is not None:
            n_in = len(out.prompt_token_ids)
            config = self.ctx.engine.config
            written = 0
            if config.enable_prefix_caching:
                full = n_in // config.block_size * config.block_size
                written = max(0, full - out.num_cached_tokens)
            usage = ResponseUsage(n_in, n_gen, n_in + n_gen,
                                  InputTokensDetails(out.num_cached_tokens, written))
        return ResponseObject(
            self.rid, self.created, self.ctx.model_name, status, output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
            tools=list(body.tools or []), text={"format": body.text_format()},
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            max_output_tokens=body.max_output_tokens, instructions=body.instructions,
            usage=usage,
            incomplete_details=IncompleteDetails("max_output_tokens")
            if status == "incomplete" else None,
            # The engine could not decode this request (finish reason "error").
            error=ResponseError("server_error", "the engine failed while generating")
            if status == "failed" else None,
            metadata=dict(body.metadata or {}), user=body.user)


def _status(finish_reason: str | None) -> str:
    """The response's status for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete"
    return "failed" if finish_reason == "error" else "completed"


def _item_status(status: str) -> str:
    """A message item's status: an item has no "failed", only an unfinished one."""
    return "completed" if status == "completed" else "incomplete"


def _text_logprobs(chat: ResponsesChatRequest, token_ids: list[int],
                   logprobs: list[Any] | None) -> list[Any]:
    """``output_text.logprobs`` (with ``include``): each token with its top_logprobs, in
    chat's shape, which is the Responses one (token, logprob, bytes, top_logprobs)."""
    if not chat.logprobs or logprobs is None:
        return []
    content = chat_logprobs(token_ids, logprobs, chat.top_logprobs or 0,
                            chat.tokens_as_ids).content
    return list(content or [])


def _output_items(plan: ToolPlan, text: str, finish_reason: str | None, status: str,
                  logprobs: list[Any] | None = None) -> list[MessageItem | FunctionCallItem]:
    """The output items of a finished generation: its text, then any tool calls."""
    message, _ = tool_message(plan, "assistant", text, finish_reason)
    items: list[MessageItem | FunctionCallItem] = []
    if message.content or not message.tool_calls:
        part = OutputText(message.content or "", logprobs=list(logprobs or []))
        items.append(MessageItem(_item_id("msg"), [part], status=_item_status(status)))
    for call in message.tool_calls:
        items.append(FunctionCallItem(_item_id("fc"), call.id, call.function.name,
                                      call.function.arguments))
    return items


def _renamed(err: APIError, chat: type[ResponsesChatRequest]) -> APIError:
    """An error raised by the chat machinery, naming the Responses field instead."""
    if err.param in chat.engine_field_names:
        err.param = chat.engine_field_names[err.param]
        err.message = chat.api_error_text(err.message)
    return err


async def create_response(ctx: ServingContext, body: ResponsesRequest, request: Request,
                          body_bytes: int = 0) -> Response:
    check_model(ctx, body.model)
    try:
        chat = body.to_chat()
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    rid, engine_id = request_ids(request, "resp", "_")
    try:
        plan = plan_tools(ctx.tool_config, chat, ctx.engine.tokenizer)
        ids = await off_loop_if_big(body_bytes, chat_prompt_ids, ctx, chat, plan)
        chat = plan.adjust_request(chat)
        streams = await start_requests(ctx, chat, engine_id, [{"prompt_token_ids": ids}],
                                       chat.requested_max_tokens, None, body_bytes)
    except APIError as err:
        raise _renamed(err, ResponsesChatRequest) from None
    run = _Run(ctx, body, rid, now_s())
    if body.stream:
        return StreamingResponse(_stream(run, chat, streams[0], plan),
                                 media_type="text/event-stream")
    try:
        (out,) = await unless_disconnected(request, final_outputs(streams))
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    (c,) = out.outputs
    status = _status(c.finish_reason)
    items = _output_items(plan, c.text, c.finish_reason, status,
                          _text_logprobs(chat, c.token_ids, c.logprobs))
    return Response(encode(run.response(status, items, out, len(c.token_ids))),
                    media_type="application/json")


async def _stream(run: _Run, chat: ResponsesChatRequest, stream: RequestStream,
                  plan: ToolPlan) -> AsyncIterator[bytes]:
    seq = -1

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _event(seq, kind, **fields)

    live = plan.mode == "none"  # with tools the text is parsed whole, at the end
    msg_id = _item_id("msg")
    sent, text, out, finish = 0, "", None, None
    n_gen, lp_sent = 0, 0
    all_lps: list[Any] = []
    try:
        yield event("response.created", response=run.response("in_progress", []))
        yield event("response.in_progress", response=run.response("in_progress", []))
        if live:
            yield event("response.output_item.added", output_index=0,
                        item=MessageItem(msg_id, [], status="in_progress"))
            yield event("response.content_part.added", item_id=msg_id, output_index=0,
                        content_index=0, part=OutputText(""))
        async for out in stream:
            (c,) = out.outputs
            text, finish, n_gen = c.text, c.finish_reason, len(c.token_ids)
            if live and len(text) > sent:
                # The logprobs of the tokens since the last delta (text held back for an
                # incomplete character comes with the token that completes it).
                lps = _text_logprobs(chat, c.token_ids[lp_sent:],
                                     None if c.logprobs is None else c.logprobs[lp_sent:])
                all_lps += lps
                lp_sent = n_gen
                yield event("response.output_text.delta", item_id=msg_id, output_index=0,
                            content_index=0, delta=text[sent:], logprobs=lps)
                sent = len(text)
        status = _status(finish)
        if live and out is not None:  # tokens after the last delta (an EOS: no text)
            last = out.outputs[0]
            all_lps += _text_logprobs(chat, last.token_ids[lp_sent:], None
                                      if last.logprobs is None else last.logprobs[lp_sent:])
        if live:
            part = OutputText(text, logprobs=all_lps)
            item: MessageItem | FunctionCallItem = MessageItem(msg_id, [part],
                                                               _item_status(status))
            yield event("response.output_text.done", item_id=msg_id, output_index=0,
                        content_index=0, text=text, logprobs=all_lps)
            yield event("response.content_part.done", item_id=msg_id, output_index=0,
                        content_index=0, part=part)
            yield event("response.output_item.done", output_index=0, item=item)
            items: list[MessageItem | FunctionCallItem] = [item]
        else:
            items = _output_items(plan, text, finish, status, _text_logprobs(
                chat, out.outputs[0].token_ids if out else [],
                out.outputs[0].logprobs if out else None))
            for i, item in enumerate(items):
                for chunk in _whole_item_events(event, i, item):
                    yield chunk
        yield event("response.completed", response=run.response(status, items, out, n_gen))
    except (EngineDeadError, RequestTimeoutError) as exc:
        err = (engine_dead_error(exc) if isinstance(exc, EngineDeadError)
               else timeout_error(exc))
        yield event("error", code=err.code, message=err.message, param=None)
    finally:
        stream.abort()


def _whole_item_events(event: Any, index: int, item: MessageItem | FunctionCallItem
                       ) -> list[bytes]:
    """A finished item's events, in the order a live one would have sent them."""
    if isinstance(item, MessageItem):
        part = item.content[0]
        return [
            event("response.output_item.added", output_index=index,
                  item=MessageItem(item.id, [], status="in_progress")),
            event("response.content_part.added", item_id=item.id, output_index=index,
                  content_index=0, part=OutputText("")),
            event("response.output_text.delta", item_id=item.id, output_index=index,
                  content_index=0, delta=part.text, logprobs=part.logprobs),
            event("response.output_text.done", item_id=item.id, output_index=index,
                  content_index=0, text=part.text, logprobs=part.logprobs),
            event("response.content_part.done", item_id=item.id, output_index=index,
                  content_index=0, part=part),
            event("response.output_item.done", output_index=index, item=item),
        ]
    started = FunctionCallItem(item.id, item.call_id, item.name, "", status="in_progress")
    return [
        event("response.output_item.added", output_index=index, item=started),
        event("response.function_call_arguments.delta", item_id=item.id,
              output_index=index, delta=item.arguments),
        event("response.function_call_arguments.done", item_id=item.id,
              output_index=index, arguments=item.arguments, name=item.name),
        event("response.output_item.done", output_index=index, item=item),
    ]
