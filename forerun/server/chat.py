"""``POST /v1/chat/completions``: messages through the model's chat template."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.chat import apply_chat_template
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import RequestOutput
from forerun.server.bodies import (
    SSE_DONE,
    UNSET,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ErrorBody,
    ErrorInfo,
    Usage,
    encode,
    sse,
)
from forerun.server.chat_extras import StreamTokenIds, add_prompt_extras
from forerun.server.chat_template_args import echo_text, response_role, template_kwargs
from forerun.server.edge import off_loop_if_big, unless_disconnected
from forerun.server.errors import APIError, engine_dead_error, timeout_error
from forerun.server.logprobs import chat_logprobs
from forerun.server.protocol import ChatCompletionRequest
from forerun.server.reasoning import (
    ChoiceReasoningStream,
    ReasoningPlan,
    plan_reasoning,
    put_reasoning,
)
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    now_s,
    request_ids,
    start_requests,
)
from forerun.server.tool_calls import ChoiceToolStream, ToolPlan, plan_tools, tool_message

logger = logging.getLogger(__name__)


def chat_prompt_ids(ctx: ServingContext, body: ChatCompletionRequest,
                    plan: ToolPlan) -> list[int]:
    """The conversation's prompt ids through the chat template; 400s name the field."""
    kwargs = template_kwargs(body, plan.tools)
    try:
        return apply_chat_template(ctx.engine.tokenizer, body.messages,
                                   chat_template=ctx.chat_template, **kwargs)
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    except jinja2.TemplateError as exc:
        # Templates raise for conversations they cannot render (e.g. role order).
        raise APIError.bad_request(f"messages: the chat template rejected them: {exc}",
                                   "messages") from None


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 request: Request, body_bytes: int = 0) -> Response:
    check_model(ctx, body.model)
    plan = plan_tools(ctx.tool_config, body, ctx.engine.tokenizer)
    ids = await off_loop_if_big(body_bytes, chat_prompt_ids, ctx, body, plan)
    body = plan.adjust_request(body)
    rplan = plan_reasoning(ctx.reasoning_parser, body, ctx.engine.tokenizer,
                           ctx.structured_enable_in_reasoning)
    if rplan is not None:
        body = rplan.adjust_request(body, forced_calls=plan.schema is not None)
    rid, engine_id = request_ids(request, "chatcmpl")
    streams = await start_requests(ctx, body, engine_id, [{"prompt_token_ids": ids}],
                                   body.requested_max_tokens, None, body_bytes)
    if body.stream:
        return StreamingResponse(_stream(ctx, body, rid, streams[0], plan, rplan),
                                 media_type="text/event-stream")
    try:
        (out,) = await unless_disconnected(request, final_outputs(streams))
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    choices = []
    role, echo = response_role(body), echo_text(body)
    for c in out.outputs:
        lps = None
        if body.logprobs and c.logprobs is not None:
            lps = chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0,
                                body.tokens_as_ids)
        reasoning, text = (None, c.text) if rplan is None else rplan.split_whole(c.text)
        if plan.reads_whole_output:
            text = c.text  # the parser leaves the reasoning out itself
        message, finish = tool_message(plan, role, text, c.finish_reason)
        if echo and plan.mode == "none":
            message.content = echo + (message.content or "")
        if rplan is not None:
            rplan.annotate(message, reasoning)
        choices.append(ChatChoice(c.index, message, lps, finish_reason=finish,
                                  stop_reason=c.stop_reason,
                                  token_ids=list(c.token_ids) if body.return_token_ids
                                  else None))
    resp = ChatCompletion(
        rid, now_s(), ctx.model_name, choices,
        Usage.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)))
    add_prompt_extras(resp, body, out)
    if out.kv_transfer_params is not None:
        resp.kv_transfer_params = out.kv_transfer_params
    return Response(encode(resp), media_type="application/json")


async def _stream(ctx: ServingContext, body: ChatCompletionRequest, rid: str,
                  stream: RequestStream, plan: ToolPlan,
                  rplan: ReasoningPlan | None = None) -> AsyncIterator[bytes]:
    created = now_s()
    usage_on = body.usage_wanted(ctx.force_include_usage)
    continuous = body.continuous_usage(ctx.force_include_usage)
    usage = None if usage_on else UNSET

    def chunk(index: int, delta: ChatDelta, finish: str | None,
              lps: ChatLogprobs | None = None, stop_reason: object = UNSET,
              first: bool = False) -> bytes:
        choice = ChatChunkChoice(index, delta, lps, finish_reason=finish,
                                 token_ids=extras.token_ids(index, out_now))
        if finish is not None:
            choice.stop_reason = stop_reason  # type: ignore[assignment]
        return sse(ChatCompletionChunk(
            rid, created, ctx.model_name, [choice],
            # vLLM's continuous usage: the prompt's length is known from the start.
            usage=Usage.of(n_prompt, n_gen[index]) if continuous else usage,
            # The prompt's ids on each choice's first (role) chunk only.
            prompt_token_ids=extras.prompt_ids(stream.prompt_token_ids) if first
            else UNSET))

    n = body.n
    sent, n_gen, done = [0] * n, [0] * n, [False] * n
    n_prompt = len(stream.prompt_token_ids)
    out_now: RequestOutput | None = None  # the output being streamed, for chunk()
    extras = StreamTokenIds(body.return_token_ids, n)
    tools = [ChoiceToolStream(plan) for _ in range(n)] if plan.mode != "none" else None
    thinking = [ChoiceReasoningStream(rplan) for _ in range(n)] if rplan else None
    role, echo = response_role(body), echo_text(body)
    try:
        for i in range(n):
            yield chunk(i, ChatDelta(role=role, content=""), None, first=True)
            if echo and tools is None:
                yield chunk(i, ChatDelta(content=echo), None)
        async for out in stream:
            n_prompt, out_now = len(out.prompt_token_ids), out
            for c in out.outputs:
                i = c.index
                # With n > 1 each output holds every completion: send only what moved.
                if done[i] or (len(c.token_ids) == n_gen[i] and c.finish_reason is None):
                    continue
                text, sent[i] = c.text[sent[i]:], len(c.text)
                lps = None
                if body.logprobs and c.logprobs is not None:
                    lps = chat_logprobs(c.token_ids[n_gen[i]:], c.logprobs[n_gen[i]:],
                                        body.top_logprobs or 0, body.tokens_as_ids)
                n_gen[i] = len(c.token_ids)
                done[i] = c.finish_reason is not None
                if tools is None and thinking is None:
                    yield chunk(i, ChatDelta(content=text), c.finish_reason, lps,
                                c.stop_reason)
                    continue
                delta, finish = ChatDelta(), c.finish_reason
                # The reasoning split first; tool calls are read from its content only
                # (a harmony parser reads the whole text and leaves the reasoning out).
                content_so_far, content_piece = c.text, text
                if thinking is not None:
                    rd = thinking[i].step(c.text, done[i])
                    put_reasoning(delta, rd.reasoning)
                    content_so_far, content_piece = rd.content_so_far, rd.content
                if tools is not None:
                    td = tools[i].delta(c.text if plan.reads_whole_output else content_so_far,
                                        done[i])
                    finish = tools[i].finish_reason(c.finish_reason)
                    if td is not None:
                        delta.content, delta.tool_calls = td.content, td.tool_calls
                elif content_piece is not None:
                    delta.content = content_piece
                if delta != ChatDelta() or finish is not None or lps is not None:
                    yield chunk(i, delta, finish, lps, c.stop_reason)
        if usage_on:
            yield sse(ChatCompletionChunk(rid, created, ctx.model_name, [],
                                          usage=Usage.of(n_prompt, sum(n_gen))))
    except (EngineDeadError, RequestTimeoutError) as exc:
        err = (engine_dead_error(exc) if isinstance(exc, EngineDeadError)
               else timeout_error(exc))
        yield sse(ErrorBody(ErrorInfo(err.message, err.type, None, err.code)))
    finally:
        stream.abort()
    yield SSE_DONE
