"""Pieces shared by the completion and chat handlers: ids, validation, merging streams."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forerun.beam_search import BeamSearchParams, BeamSearchStream, check_beam_search
from forerun.engine.async_llm import AsyncLLM, RequestStream
from forerun.engine.processor import ProcessedPrompt
from forerun.outputs import RequestOutput
from forerun.sampling_params import SamplingParams
from forerun.server.edge import off_loop_if_big
from forerun.server.errors import APIError
from forerun.server.protocol import _BaseRequest
from forerun.server.tool_calls import ToolCallConfig


@dataclass(slots=True)
class ServingContext:
    """What every handler needs: the engine and how the server presents itself."""

    engine: AsyncLLM
    model_name: str
    # Every name a request may send as ``model`` (--served-model-name); model_name is first.
    served_model_names: tuple[str, ...] = ()
    # Called for each request queued (the server's metrics and request log).
    on_request: Callable[[str, ProcessedPrompt, SamplingParams], None] | None = None
    # --enable-force-include-usage: every stream ends with a usage chunk, asked or not.
    force_include_usage: bool = False
    # --return-tokens-as-token-ids: the default of requests that leave it null.
    return_tokens_as_token_ids: bool = False
    # --enable-auto-tool-choice / --tool-call-parser, and --chat-template.
    tool_config: ToolCallConfig = field(default_factory=ToolCallConfig)
    chat_template: str | None = None
    # --structured-outputs-config's disable_any_whitespace, for requests that set none.
    disable_any_whitespace: bool | None = None
    # --reasoning-parser's name (forerun/server/reasoning.py); None: no reasoning split.
    reasoning_parser: str | None = None
    # --structured-outputs-config's enable_in_reasoning: a grammar constrains the
    # reasoning too, rather than starting after it.
    structured_enable_in_reasoning: bool = False


def request_ids(request: Any, prefix: str, sep: str = "-") -> tuple[str, str]:
    """(the response's id, the engine's request id) for one HTTP request.

    As in vLLM, a client's ``X-Request-Id`` header names the response
    (``chatcmpl-<X-Request-Id>``). Clients may reuse a header value, and two requests in
    flight under one engine id would clash, so the engine's id then gets a suffix.
    """
    header = request.headers.get("x-request-id") if request is not None else None
    if not header:
        rid = f"{prefix}{sep}{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}{sep}{header}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def now_s() -> int:
    return int(time.time())


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name and model not in ctx.served_model_names:
        raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError",
                       param="model", code="model_not_found")


def resolve_max_tokens(ctx: ServingContext, requested: int | None, default: int | None,
                       prompt_len: int) -> int:
    """Explicit max_tokens must fit the context; a missing one is capped to what is left."""
    room = ctx.engine.max_model_len - prompt_len
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if requested >= 1 and requested > room:
        raise APIError.bad_request(
            f"max_tokens: this model's maximum context length is {ctx.engine.max_model_len} "
            f"tokens; the prompt has {prompt_len} tokens, so at most {room} can be "
            f"generated, but {requested} were requested", "max_tokens")
    return requested


def plan_requests(ctx: ServingContext, body: _BaseRequest, prompts: Sequence[Any],
                  requested: int | None, default_max: int | None,
                  ) -> list[tuple[ProcessedPrompt, SamplingParams]]:
    """Tokenise and check every prompt and its params; the first bad one raises a 400.

    Pure work on the request (no engine state), so it may run on a worker thread.
    """
    processor = ctx.engine.processor
    plans: list[tuple[ProcessedPrompt, SamplingParams]] = []
    try:
        keep = body.truncation(ctx.engine.max_model_len)
        for p in prompts:
            processed = processor.process_prompt(p, keep)
            n = len(processed.prompt_token_ids)
            params = body.sampling_params(resolve_max_tokens(ctx, requested, default_max, n),
                                          keep)
            so = params.structured_outputs
            if so is not None and so.disable_any_whitespace is None \
                    and ctx.disable_any_whitespace is not None:
                params.structured_outputs = dataclasses.replace(
                    so, disable_any_whitespace=ctx.disable_any_whitespace)
            plans.append((processed, processor.process_params(params)))
    except ValueError as exc:
        raise APIError.bad_request(body.api_error_text(str(exc))) from None
    return plans


async def start_requests(ctx: ServingContext, body: _BaseRequest, base_id: str,
                         prompts: Sequence[Any], requested: int | None,
                         default_max: int | None, body_bytes: int = 0) -> list[RequestStream]:
    """Validate every prompt first, then queue them all: a bad one queues nothing.

    The whole request is admitted or refused at once (``n`` x prompts sequences).
    """
    engine = ctx.engine
    if body.return_tokens_as_token_ids is None:
        body.return_tokens_as_token_ids = ctx.return_tokens_as_token_ids
    try:
        engine.check_admission(len(prompts) * body.n)
    except ValueError as exc:
        raise APIError.bad_request(str(exc), "n") from None
    plans = await off_loop_if_big(body_bytes, plan_requests, ctx, body, prompts, requested,
                                  default_max)
    if body.use_beam_search:
        return _beam_searches(ctx, body, base_id, plans)  # type: ignore[return-value]
    streams: list[RequestStream] = []
    try:
        for i, (processed, params) in enumerate(plans):
            rid = base_id if len(plans) == 1 else f"{base_id}-{i}"
            streams.append(engine.add_processed_request(rid, processed, params))
            if ctx.on_request is not None:
                ctx.on_request(rid, processed, params)
    except ValueError as exc:
        for s in streams:
            s.abort()
        raise APIError.bad_request(str(exc)) from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


def _beam_searches(ctx: ServingContext, body: _BaseRequest, base_id: str,
                   plans: list[tuple[ProcessedPrompt, SamplingParams]],
                   ) -> list[BeamSearchStream]:
    """``use_beam_search``: one search of width ``n`` per prompt, read like a stream (its
    one output carries the n best beams as the n completions)."""
    proc = ctx.engine.processor
    searches = []
    for i, (processed, params) in enumerate(plans):
        assert params.max_tokens is not None
        beam = BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                length_penalty=body.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)
        try:
            check_beam_search(beam, len(processed.prompt_token_ids), proc.max_model_len,
                              proc.logprobs_limit)
        except ValueError as exc:
            raise APIError.bad_request(str(exc)) from None
        rid = base_id if len(plans) == 1 else f"{base_id}-{i}"
        searches.append(BeamSearchStream(ctx.engine, rid, processed.prompt,
                                         processed.prompt_token_ids, beam,
                                         params.skip_special_tokens))
        if ctx.on_request is not None:
            ctx.on_request(rid, processed, params)
    return searches


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for task in pending:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Run every request to the end; the last output of each, in request order."""
    last: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            last[i] = out
    finally:
        for s in streams:
            s.abort()
    assert all(o is not None for o in last)
    return last  # type: ignore[return-value]
