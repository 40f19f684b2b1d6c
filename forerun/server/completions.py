"""``POST /v1/completions``: ``n`` choices per prompt, streamed or whole."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import PositionLogprobs, RequestOutput
from forerun.server.bodies import (
    SSE_DONE,
    UNSET,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    ErrorBody,
    ErrorInfo,
    PromptLogprobs,
    Usage,
    encode,
    sse,
)
from forerun.server.edge import unless_disconnected
from forerun.server.errors import APIError, engine_dead_error, timeout_error
from forerun.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_json,
)
from forerun.server.protocol import CompletionRequest, completion_prompts
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    merge_streams,
    now_s,
    request_ids,
    start_requests,
)

logger = logging.getLogger(__name__)

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def _prompt_text(ctx: ServingContext, prompt: str | None, ids: list[int]) -> str:
    if prompt is not None:
        return prompt
    return ctx.engine.tokenizer.decode(ids, skip_special_tokens=False)


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request,
                            body_bytes: int = 0) -> Response:
    check_model(ctx, body.model)
    try:
        prompts = completion_prompts(body.prompt)
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    rid, engine_id = request_ids(request, "cmpl")
    streams = await start_requests(ctx, body, engine_id, prompts, body.max_tokens,
                                   _DEFAULT_MAX_TOKENS, body_bytes)
    if body.stream:
        return StreamingResponse(_stream(ctx, body, rid, streams),
                                 media_type="text/event-stream")
    try:
        outs = await unless_disconnected(request, final_outputs(streams))
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    choices, n_prompt, n_gen = [], 0, 0
    for i, out in enumerate(outs):
        prompt_lps = _prompt_logprobs(body, out)
        for c in out.outputs:
            # Choices of prompt i are i * n + index, as in OpenAI and vLLM.
            choice = _choice(ctx, body, i * body.n + c.index, out, c.text, c.token_ids,
                             c.logprobs, 0, True)
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
            choice.prompt_logprobs = prompt_lps
            choices.append(choice)
            n_gen += len(c.token_ids)
        n_prompt += len(out.prompt_token_ids)
    resp = Completion(rid, now_s(), ctx.model_name, choices, usage=Usage.of(n_prompt, n_gen))
    if len(outs) == 1 and outs[0].kv_transfer_params is not None:
        resp.kv_transfer_params = outs[0].kv_transfer_params
    return Response(encode(resp), media_type="application/json")


def _choice(ctx: ServingContext, body: CompletionRequest, index: int, out: RequestOutput,
            text: str, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
            offset: int, first: bool) -> CompletionChoice:
    """A choice (or a stream chunk's) for new ``text``/``token_ids``, offsets from offset.

    ``first``: the choice's first piece, which carries the echoed prompt (with its
    logprobs) and, with return_token_ids, the prompt's token ids.
    """
    prefix = ""
    if first and body.echo:
        prefix = _prompt_text(ctx, out.prompt, out.prompt_token_ids)
    lps = None
    if body.logprobs is not None and logprobs is not None:
        lps = completion_logprobs(token_ids, logprobs, body.logprobs, offset + len(prefix),
                                  body.tokens_as_ids)
        if first and body.echo:
            lps = join_logprobs(_echo_logprobs(ctx, body, out), lps)
    text = prefix + text
    choice = CompletionChoice(index, text, lps)
    if body.return_token_ids:
        choice.token_ids = list(token_ids)
        if first:
            choice.prompt_token_ids = list(out.prompt_token_ids)
    return choice


def _prompt_logprobs(body: CompletionRequest, out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a choice: whenever the prompt's were computed (asked
    for, or for an echo with ``logprobs``), with the count asked for; else null."""
    if out.prompt_logprobs is None:
        return None
    k = body.prompt_logprobs if body.prompt_logprobs is not None else body.logprobs
    if k is None:
        return None
    return prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs, k)


def _echo_logprobs(ctx: ServingContext, body: CompletionRequest,
                   out: RequestOutput) -> CompletionLogprobs:
    ids = out.prompt_token_ids
    first = ctx.engine.tokenizer.decode(ids[:1], skip_special_tokens=False) if ids else ""
    return echo_logprobs(ids, out.prompt_logprobs or [None] * len(ids), first,
                         body.logprobs or 0, body.tokens_as_ids)


async def _stream(ctx: ServingContext, body: CompletionRequest, rid: str,
                  streams: list[RequestStream]) -> AsyncIterator[bytes]:
    created = now_s()
    usage_on = body.usage_wanted(ctx.force_include_usage)
    continuous = body.continuous_usage(ctx.force_include_usage)
    num_choices = len(streams) * body.n  # choice j = prompt j // n, completion j % n
    sent = [0] * num_choices
    n_prompt, n_gen = [0] * len(streams), [0] * num_choices
    offset = [0] * num_choices  # text offset of the next token, for logprobs
    done = [False] * num_choices
    try:
        async for i, out in merge_streams(streams):
            n_prompt[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                j = i * body.n + c.index
                # With n > 1 each output holds every completion: send only what moved.
                if done[j] or (len(c.token_ids) == n_gen[j] and c.finish_reason is None):
                    continue
                k, first = n_gen[j], sent[j] == 0 and n_gen[j] == 0
                choice = _choice(ctx, body, j, out, c.text[sent[j]:], c.token_ids[k:],
                                 c.logprobs[k:] if c.logprobs is not None else None,
                                 offset[j], first)
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
                choice.prompt_logprobs = UNSET  # not streamed (vLLM's chunks lack it)
                # The next token's offset: past everything this choice has shown so far.
                offset[j] += len(choice.text)
                sent[j], n_gen[j] = len(c.text), len(c.token_ids)
                done[j] = c.finish_reason is not None
                # vLLM's continuous usage: this choice's prompt and tokens so far.
                usage = (Usage.of(n_prompt[i], n_gen[j]) if continuous
                         else None if usage_on else UNSET)
                yield sse(Completion(rid, created, ctx.model_name, [choice], usage=usage))
        if usage_on:
            yield sse(Completion(rid, created, ctx.model_name, [],
                                 usage=Usage.of(sum(n_prompt), sum(n_gen))))
    except (EngineDeadError, RequestTimeoutError) as exc:
        err = (engine_dead_error(exc) if isinstance(exc, EngineDeadError)
               else timeout_error(exc))
        yield sse(ErrorBody(ErrorInfo(err.message, err.type, None, err.code)))
    finally:
        # Runs on client disconnect too (the response task is cancelled): free KV blocks.
        for s in streams:
            s.abort()
    yield SSE_DONE
