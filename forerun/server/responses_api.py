"""``POST /v1/responses``: OpenAI's Responses API, run as the chat completion it amounts to.

Non-streamed, the answer is a ``response`` object whose ``output`` holds a ``message``
item (``output_text`` content) and, with tools, ``function_call`` items. Streamed, it is
OpenAI's event sequence (``response.created`` ... ``response.completed``), each event with
a ``sequence_number``. As in vLLM, a response cut by ``max_output_tokens`` ends with
``response.completed`` carrying ``status: "incomplete"``. Nothing is stored.

With ``--reasoning-parser`` the model's thinking is a ``reasoning`` item before the
message (vLLM's shape: ``summary: []``, ``content: [{"type": "reasoning_text", ...}]``),
counted in ``usage.output_tokens_details.reasoning_tokens`` and streamed as
``response.reasoning_text.delta`` / ``.done``; the message holds the answer only, tool
calls are read from it, and ``text.format`` constrains it from the token after the
reasoning ends, as on chat (``forerun/server/reasoning.py``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import CompletionOutput, RequestOutput
from forerun.server.bodies import encode
from forerun.server.chat import chat_prompt_ids
from forerun.server.edge import off_loop_if_big, unless_disconnected
from forerun.server.errors import APIError, engine_dead_error, timeout_error
from forerun.server.logprobs import chat_logprobs
from forerun.server.reasoning import ChoiceReasoningStream, ReasoningPlan, plan_reasoning
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


class ReasoningText(msgspec.Struct):
    """A reasoning item's content part: the model's thinking as it wrote it."""

    text: str
    type: str = "reasoning_text"


class ReasoningItem(msgspec.Struct):
    """The model's thinking (``--reasoning-parser``) as vLLM's Responses API lists it:
    the text as ``reasoning_text`` content and no summary (none is written)."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"
    type: str = "reasoning"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


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
    output: list[OutputItem]
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
    reasoning: dict[str, Any] | None = None  # the request's, echoed
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

    def response(self, status: str, output: list[OutputItem],
                 out: RequestOutput | None = None, n_gen: int = 0,
                 n_reasoning: int = 0) -> ResponseObject:
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
                                  InputTokensDetails(out.num_cached_tokens, written),
                                  OutputTokensDetails(n_reasoning))
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
            metadata=dict(body.metadata or {}), user=body.user, reasoning=body.reasoning)


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


def _output_items(plan: ToolPlan, rplan: ReasoningPlan | None, text: str,
                  finish_reason: str | None, status: str, logprobs: list[Any] | None = None,
                  msg_id: str | None = None, rs_id: str | None = None) -> list[OutputItem]:
    """The output items of a finished generation: its thinking (with a reasoning parser),
    its text, then any tool calls. The thinking comes first unless the text began before
    it. ``msg_id`` / ``rs_id``: the ids a stream already announced the items under."""
    reasoning, content, first = None, text, True
    if rplan is not None:
        reasoning, content = rplan.split_whole(text)
        first = rplan.reasoning_first(text)
    # Tool calls come from the answer only (harmony's parser reads the whole text and
    # skips the thinking itself), as on chat.
    message, _ = tool_message(plan, "assistant", text if plan.reads_whole_output else content,
                              finish_reason)
    answer: list[OutputItem] = []
    if message.content or not message.tool_calls:
        part = OutputText(message.content or "", logprobs=list(logprobs or []))
        answer.append(MessageItem(msg_id or _item_id("msg"), [part],
                                  status=_item_status(status)))
    for call in message.tool_calls:
        answer.append(FunctionCallItem(_item_id("fc"), call.id, call.function.name,
                                       call.function.arguments))
    if not reasoning:
        return answer
    assert rplan is not None
    # A thought the output went past is complete even when the answer was cut.
    done = status == "completed" or rplan.reasoning_ended(text)
    thought = ReasoningItem(rs_id or _item_id("rs"), [ReasoningText(reasoning)],
                            status="completed" if done else _item_status(status))
    return [thought, *answer] if first else [*answer, thought]


def _reasoning_tokens(rplan: ReasoningPlan | None, chat: ResponsesChatRequest,
                      c: CompletionOutput | None, items: list[OutputItem]) -> int:
    """usage's ``reasoning_tokens``: the output tokens up to the end of the thinking."""
    thought = next((i for i in items if isinstance(i, ReasoningItem)), None)
    if rplan is None or c is None or thought is None:
        return 0
    return rplan.reasoning_token_count(c.token_ids, thought.content[0].text,
                                       chat.skip_special_tokens)


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
        rplan = plan_reasoning(ctx.reasoning_parser, chat, ctx.engine.tokenizer,
                               ctx.structured_enable_in_reasoning)
        if rplan is not None:  # text.format (and forced calls) after the thinking
            chat = rplan.adjust_request(chat, forced_calls=plan.schema is not None)
        streams = await start_requests(ctx, chat, engine_id, [{"prompt_token_ids": ids}],
                                       chat.requested_max_tokens, None, body_bytes)
    except APIError as err:
        raise _renamed(err, ResponsesChatRequest) from None
    run = _Run(ctx, body, rid, now_s())
    if body.stream:
        return StreamingResponse(_stream(run, chat, streams[0], plan, rplan),
                                 media_type="text/event-stream")
    try:
        (out,) = await unless_disconnected(request, final_outputs(streams))
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    (c,) = out.outputs
    status = _status(c.finish_reason)
    items = _output_items(plan, rplan, c.text, c.finish_reason, status,
                          _text_logprobs(chat, c.token_ids, c.logprobs))
    return Response(encode(run.response(status, items, out, len(c.token_ids),
                                        _reasoning_tokens(rplan, chat, c, items))),
                    media_type="application/json")


Emit = Callable[..., bytes]


class _LiveItems:
    """A stream's items while they grow (no tools: nothing to parse whole): the thinking
    (with a reasoning parser) and the text, each announced when its first piece comes and
    streamed in deltas. The thinking's item closes when the answer starts, the rest at the
    end, with the items of the whole output (the same ids and texts)."""

    def __init__(self, event: Emit, chat: ResponsesChatRequest,
                 rplan: ReasoningPlan | None) -> None:
        self.event, self.chat, self.rplan = event, chat, rplan
        self.thinking = ChoiceReasoningStream(rplan) if rplan is not None else None
        self.msg_id, self.rs_id = _item_id("msg"), _item_id("rs")
        self.index: dict[str, int] = {}  # item type -> output_index, by first piece
        self.closed: set[str] = set()
        self.reasoning = ""
        self.sent = 0  # characters of the text streamed (no reasoning parser)
        self.lp_sent = 0  # tokens whose logprobs were sent
        self.lps: list[Any] = []

    def step(self, c: CompletionOutput) -> list[bytes]:
        """The events for what output ``c`` (the text so far) adds."""
        finished = c.finish_reason is not None
        if self.thinking is None:
            thought, text = None, c.text[self.sent:] or None
            self.sent = len(c.text)
        else:
            d = self.thinking.step(c.text, finished)
            thought, text = d.reasoning, d.content
        out: list[bytes] = []
        pieces = [("reasoning", thought), ("message", text)]
        if thought and text and not self.index and self.rplan is not None \
                and not self.rplan.reasoning_first(c.text, finished):
            pieces.reverse()  # both begin in this step: in the order the text has them
        for kind, piece in pieces:
            if not piece:
                continue
            if kind == "reasoning":
                out += self._thought(piece)
            else:
                out += self._text(piece, c)
        if "reasoning" in self.index and "reasoning" not in self.closed \
                and self.rplan is not None and self.rplan.reasoning_ended(c.text):
            item = ReasoningItem(self.rs_id, [ReasoningText(self.reasoning)])
            out += self._close(item)
        return out

    def _open(self, item: OutputItem) -> list[bytes]:
        kind = item.type
        self.index[kind] = i = len(self.index)
        if isinstance(item, ReasoningItem):
            started: OutputItem = ReasoningItem(item.id, [], status="in_progress")
            part: ReasoningText | OutputText = ReasoningText("")
        else:
            started, part = MessageItem(item.id, [], status="in_progress"), OutputText("")
        return [self.event("response.output_item.added", output_index=i, item=started),
                self.event("response.content_part.added", item_id=item.id, output_index=i,
                           content_index=0, part=part)]

    def _thought(self, piece: str) -> list[bytes]:
        if "reasoning" in self.closed:
            # Thinking after the answer began (harmony's analysis after its final message;
            # the model stops before that): its item is done, response.completed has it.
            return []
        out = [] if "reasoning" in self.index else self._open(ReasoningItem(self.rs_id, []))
        self.reasoning += piece
        out.append(self.event("response.reasoning_text.delta", item_id=self.rs_id,
                              output_index=self.index["reasoning"], content_index=0,
                              delta=piece))
        return out

    def _text(self, piece: str, c: CompletionOutput) -> list[bytes]:
        out = [] if "message" in self.index else self._open(MessageItem(self.msg_id, []))
        # The logprobs of the tokens since the last text delta (text held back for an
        # incomplete character, or thinking, comes with the token that completes it).
        lps = self.logprobs_since(c)
        out.append(self.event("response.output_text.delta", item_id=self.msg_id,
                              output_index=self.index["message"], content_index=0,
                              delta=piece, logprobs=lps))
        return out

    def logprobs_since(self, c: CompletionOutput) -> list[Any]:
        """The text logprobs of ``c``'s tokens not sent yet, now counted as sent."""
        lps = _text_logprobs(self.chat, c.token_ids[self.lp_sent:], None
                             if c.logprobs is None else c.logprobs[self.lp_sent:])
        self.lps += lps
        self.lp_sent = len(c.token_ids)
        return lps

    def _close(self, item: OutputItem) -> list[bytes]:
        i = self.index[item.type]
        self.closed.add(item.type)
        if isinstance(item, ReasoningItem):
            part: ReasoningText | OutputText = item.content[0]
            done = self.event("response.reasoning_text.done", item_id=item.id,
                              output_index=i, content_index=0, text=part.text)
        else:
            assert isinstance(item, MessageItem)
            part = item.content[0]
            done = self.event("response.output_text.done", item_id=item.id, output_index=i,
                              content_index=0, text=part.text, logprobs=part.logprobs)
        return [done,
                self.event("response.content_part.done", item_id=item.id, output_index=i,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=i, item=item)]

    def finish(self, items: list[OutputItem]) -> list[bytes]:
        """The closing events, with ``items`` (the whole output's, under this stream's ids)
        put in the order the stream announced them."""
        out: list[bytes] = []
        for item in items:  # an answer with no text is announced only now
            if item.type not in self.index:
                out += self._open(item)
        items.sort(key=lambda item: self.index[item.type])
        for item in items:
            if item.type not in self.closed:
                out += self._close(item)
        return out


async def _stream(run: _Run, chat: ResponsesChatRequest, stream: RequestStream,
                  plan: ToolPlan, rplan: ReasoningPlan | None = None) -> AsyncIterator[bytes]:
    seq = -1

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _event(seq, kind, **fields)

    # With tools the text is parsed whole, at the end, and its items (the thinking's too)
    # are sent whole then.
    live = _LiveItems(event, chat, rplan) if plan.mode == "none" else None
    out, text, finish, n_gen = None, "", None, 0
    try:
        yield event("response.created", response=run.response("in_progress", []))
        yield event("response.in_progress", response=run.response("in_progress", []))
        async for out in stream:
            (c,) = out.outputs
            text, finish, n_gen = c.text, c.finish_reason, len(c.token_ids)
            if live is not None:
                for chunk in live.step(c):
                    yield chunk
        status = _status(finish)
        last = out.outputs[0] if out is not None else None
        if live is not None:
            if last is not None:  # tokens after the last delta (an EOS: no text)
                live.logprobs_since(last)
            items = _output_items(plan, rplan, text, finish, status, live.lps,
                                  live.msg_id, live.rs_id)
            for chunk in live.finish(items):
                yield chunk
        else:
            items = _output_items(plan, rplan, text, finish, status, _text_logprobs(
                chat, last.token_ids if last else [], last.logprobs if last else None))
            for i, item in enumerate(items):
                for chunk in _whole_item_events(event, i, item):
                    yield chunk
        yield event("response.completed", response=run.response(
            status, items, out, n_gen, _reasoning_tokens(rplan, chat, last, items)))
    except (EngineDeadError, RequestTimeoutError) as exc:
        err = (engine_dead_error(exc) if isinstance(exc, EngineDeadError)
               else timeout_error(exc))
        yield event("error", code=err.code, message=err.message, param=None)
    finally:
        stream.abort()


def _whole_item_events(event: Emit, index: int, item: OutputItem) -> list[bytes]:
    """A finished item's events, in the order a live one would have sent them."""
    if isinstance(item, FunctionCallItem):
        started = FunctionCallItem(item.id, item.call_id, item.name, "", status="in_progress")
        return [
            event("response.output_item.added", output_index=index, item=started),
            event("response.function_call_arguments.delta", item_id=item.id,
                  output_index=index, delta=item.arguments),
            event("response.function_call_arguments.done", item_id=item.id,
                  output_index=index, arguments=item.arguments, name=item.name),
            event("response.output_item.done", output_index=index, item=item),
        ]
    where = {"item_id": item.id, "output_index": index, "content_index": 0}
    out: list[bytes] = []
    if isinstance(item, ReasoningItem):
        thought = item.content[0]
        out += [
            event("response.output_item.added", output_index=index,
                  item=ReasoningItem(item.id, [], status="in_progress")),
            event("response.content_part.added", **where, part=ReasoningText("")),
            event("response.reasoning_text.delta", **where, delta=thought.text),
            event("response.reasoning_text.done", **where, text=thought.text),
            event("response.content_part.done", **where, part=thought),
        ]
    else:
        part = item.content[0]
        out += [
            event("response.output_item.added", output_index=index,
                  item=MessageItem(item.id, [], status="in_progress")),
            event("response.content_part.added", **where, part=OutputText("")),
            event("response.output_text.delta", **where, delta=part.text,
                  logprobs=part.logprobs),
            event("response.output_text.done", **where, text=part.text,
                  logprobs=part.logprobs),
            event("response.content_part.done", **where, part=part),
        ]
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out
