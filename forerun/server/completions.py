"""``POST /v1/completions``: ``n`` choices per prompt, streamed or whole."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.server.edge import unless_disconnected
from forerun.server.errors import APIError, engine_dead_error, timeout_error
from forerun.server.logprobs import completion_logprobs
from forerun.server.protocol import CompletionRequest, completion_prompts
from forerun.server.responses import (
    SSE_DONE,
    UNSET,
    Completion,
    CompletionChoice,
    ErrorBody,
    ErrorInfo,
    Usage,
    encode,
    sse,
)
from forerun.server.serving import (
    ServingContext,
    check_model,
    final_outputs,
    merge_streams,
    new_id,
    now_s,
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
    rid = new_id("cmpl")
    streams = await start_requests(ctx, body, rid, prompts, body.max_tokens,
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
        for c in out.outputs:
            text = c.text
            prefix = len(text)
            if body.echo:
                text = _prompt_text(ctx, out.prompt, out.prompt_token_ids) + text
            lps = None
            if body.logprobs is not None and c.logprobs is not None:
                lps = completion_logprobs(c.token_ids, c.logprobs, body.logprobs,
                                          len(text) - prefix)
            # Choices of prompt i are i * n + index, as in OpenAI and vLLM.
            choices.append(CompletionChoice(i * body.n + c.index, text, lps,
                                            finish_reason=c.finish_reason))
            n_gen += len(c.token_ids)
        n_prompt += len(out.prompt_token_ids)
    resp = Completion(rid, now_s(), ctx.model_name, choices, usage=Usage.of(n_prompt, n_gen))
    return Response(encode(resp), media_type="application/json")


async def _stream(ctx: ServingContext, body: CompletionRequest, rid: str,
                  streams: list[RequestStream]) -> AsyncIterator[bytes]:
    created, usage_on = now_s(), body.include_usage
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
                text = c.text[sent[j]:]
                if body.echo and sent[j] == 0 and n_gen[j] == 0:
                    text = _prompt_text(ctx, out.prompt, out.prompt_token_ids) + text
                    offset[j] = len(text) - len(c.text)
                lps = None
                if body.logprobs is not None and c.logprobs is not None:
                    k = n_gen[j]
                    lps = completion_logprobs(c.token_ids[k:], c.logprobs[k:], body.logprobs,
                                              offset[j])
                    offset[j] += sum(len(t) for t in lps.tokens)
                sent[j], n_gen[j] = len(c.text), len(c.token_ids)
                done[j] = c.finish_reason is not None
                chunk = Completion(
                    rid, created, ctx.model_name,
                    [CompletionChoice(j, text, lps, finish_reason=c.finish_reason)],
                    usage=None if usage_on else UNSET)
                yield sse(chunk)
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
