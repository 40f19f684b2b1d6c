"""Ollama's native API (``/api/*``) on the same app and engine as the OpenAI routes.

A thin translation: an Ollama body becomes forerun's OpenAI chat request
(``ollama_protocol.OllamaEngineRequest``), which goes through the same chat template, tool
plan, structured output and ``start_requests`` as ``/v1/chat/completions``; the engine's
outputs are written back as Ollama's NDJSON stream or one object. Errors are Ollama's
``{"error": "..."}`` with Ollama's status (400 bad field, 404 unknown model). What differs
from Ollama, and why, is in docs/serving.md.

``think`` needs ``--reasoning-parser`` (without it: Ollama's 400 for a model that does not
think); with it the thinking comes back in ``message.thinking`` (``/api/chat``) or
``thinking`` (``/api/generate``), split by the same parser as chat's ``reasoning``, and
``format`` constrains the answer after it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

import forerun
from forerun.engine.async_llm import (
    AsyncLLM,
    EngineOverloadedError,
    RequestTimeoutError,
)
from forerun.engine.core_client import EngineDeadError
from forerun.pooling_params import PoolingParams
from forerun.server.chat import chat_prompt_ids
from forerun.server.edge import (
    ClientDisconnected,
    off_loop_if_big,
    parse_body,
    read_body,
    unless_disconnected,
)
from forerun.server.embeddings import encode_prompts
from forerun.server.errors import APIError, _validation_error
from forerun.server.ollama_models import CAPABILITIES, ModelFacts, rfc3339
from forerun.server.ollama_protocol import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    OllamaEngineRequest,
    OllamaError,
    ShowRequest,
    format_fields,
    parse_options,
    sampling_fields,
    template_messages,
)
from forerun.server.ollama_writer import ResponseWriter, Timing
from forerun.server.reasoning import plan_reasoning, thinking_fields
from forerun.server.serving import ServingContext, request_ids, start_requests
from forerun.server.tool_calls import ToolPlan, plan_tools

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


async def _embed(engine: AsyncLLM, texts: list[str], normalize: bool,
                 dimensions: int | None, request: Request) -> tuple[list[list[float]], int]:
    """(one embedding per text, prompt tokens pooled), through the pooling path the OpenAI
    ``/v1/embeddings`` route uses (last-token pooling, the served decoder's own hidden
    states). ``/api/embed`` normalises, the legacy ``/api/embeddings`` does not (Ollama)."""
    try:
        params = PoolingParams(dimensions=dimensions, normalize=normalize)
    except ValueError as exc:
        raise OllamaError(400, str(exc)) from None
    outs = await encode_prompts(engine, texts, params, f"embd-{uuid.uuid4().hex}",
                                request=request)
    return [o.outputs.data for o in outs], sum(len(o.prompt_token_ids) for o in outs)


# Ollama's model-management routes: forerun serves the one model it was started with.
# 501 (not 400): the request is well formed, this server does not implement the operation.
_MANAGEMENT = (("/api/pull", "POST"), ("/api/push", "POST"), ("/api/create", "POST"),
               ("/api/delete", "DELETE"), ("/api/copy", "POST"),
               ("/api/blobs/{digest}", "POST"), ("/api/blobs/{digest}", "HEAD"))


def register_ollama_routes(app: FastAPI, ctx: ServingContext, body_limit: int) -> None:
    """Add Ollama's ``/api/*`` routes to ``app``, serving ``ctx``'s engine."""
    facts: list[ModelFacts] = []  # computed on first use: build_app stays cheap

    def model_facts() -> ModelFacts:
        if not facts:
            facts.append(ModelFacts.of(ctx.engine))
        return facts[0]

    async def run(request: Request, model: type[M],
                  handle: Callable[[M, int, int], Awaitable[Response]]) -> Response:
        """Read and parse the body, answer it; every error in Ollama's shape."""
        t0 = time.perf_counter_ns()
        try:
            raw = await read_body(request, body_limit)
            if not raw.strip():
                raise OllamaError(400, "missing request body")
            body = await off_loop_if_big(len(raw), parse_body, model, raw)
            return await handle(body, t0, len(raw))
        except ClientDisconnected:
            return Response(status_code=499)
        except OllamaError as exc:
            return _error(exc.status, exc.message)
        except APIError as exc:
            return _error(exc.status, exc.message)
        except RequestValidationError as exc:
            return _error(400, _validation_error(exc).message)
        except (EngineDeadError, EngineOverloadedError, RequestTimeoutError) as exc:
            return _error(504 if isinstance(exc, RequestTimeoutError) else 503, str(exc))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await run(request, GenerateRequest,
                         lambda b, t0, n: _generate(ctx, b, request, t0, n, chat=False))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await run(request, ChatRequest,
                         lambda b, t0, n: _generate(ctx, b, request, t0, n, chat=True))

    @app.api_route("/api/tags", methods=["GET", "HEAD"])
    async def tags() -> Response:
        f = model_facts()
        return JSONResponse({"models": [f.tag(n) for n in _listed_names(ctx)]})

    @app.get("/api/ps")
    async def ps() -> Response:
        f = model_facts()
        return JSONResponse({"models": [f.process(n) for n in _listed_names(ctx)]})

    @app.api_route("/api/version", methods=["GET", "HEAD"])
    async def version() -> Response:
        return JSONResponse({"version": forerun.__version__})

    async def show_body(body: ShowRequest, _t0: int, _n: int) -> Response:
        _check_model(ctx, body.model or body.name)
        f = model_facts()
        tokenizer = ctx.engine.tokenizer
        template = ctx.chat_template or getattr(tokenizer, "chat_template", None) or ""
        return JSONResponse({
            "modelfile": "", "parameters": "", "template": template,
            "details": f.details(), "model_info": f.model_info(),
            # Ollama lists "thinking" for models whose thinking it can split off.
            "capabilities": [*CAPABILITIES, *(["thinking"] if ctx.reasoning_parser else [])],
            "modified_at": f.modified_at})

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        return await run(request, ShowRequest, show_body)

    async def embed_body(body: EmbedRequest, t0: int, _n: int, legacy: bool,
                         request: Request) -> Response:
        _check_model(ctx, body.model)
        # ``truncate`` is accepted, but an input longer than the context is a 400 whatever
        # it says: Ollama cuts such an input's end, vLLM's truncation keeps its end.
        texts = [body.prompt or ""] if legacy else (
            [body.input] if isinstance(body.input, str) else list(body.input or []))
        if not texts or not all(texts):
            raise OllamaError(400, "input: must hold at least one non-empty text")
        vectors, tokens = await _embed(ctx.engine, texts, not legacy,
                                       None if legacy else body.dimensions, request)
        if legacy:
            return JSONResponse({"embedding": vectors[0]})
        total = time.perf_counter_ns() - t0
        return JSONResponse({"model": body.model, "embeddings": vectors,
                             "total_duration": total, "load_duration": 0,
                             "prompt_eval_count": tokens})

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        return await run(request, EmbedRequest,
                         lambda b, t0, n: embed_body(b, t0, n, False, request))

    @app.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        return await run(request, EmbedRequest,
                         lambda b, t0, n: embed_body(b, t0, n, True, request))

    async def management(request: Request) -> Response:
        what = request.url.path.rsplit("/api/", 1)[-1].split("/")[0]
        return _error(501, f"{what}: not supported: forerun serves only the model it was "
                           f"started with ({ctx.model_name}); restart `forerun serve` with "
                           "another model to change it")

    for path, method in _MANAGEMENT:
        app.add_api_route(path, management, methods=[method], include_in_schema=False)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _listed_names(ctx: ServingContext) -> list[str]:
    """The served names as Ollama lists models: with a tag (``name:latest``)."""
    names = ctx.served_model_names or (ctx.model_name,)
    return [n if ":" in n else f"{n}:latest" for n in names]


def _check_model(ctx: ServingContext, name: str) -> None:
    if not name:
        raise OllamaError(400, "model is required")
    names = ctx.served_model_names or (ctx.model_name,)
    if name not in names and name not in _listed_names(ctx):
        raise OllamaError(404, f"model '{name}' not found")


# Ollama's think levels (gpt-oss's reasoning effort); booleans switch thinking on or off.
THINK_LEVELS = ("high", "medium", "low")


def _check_think(ctx: ServingContext, body: ChatRequest | GenerateRequest) -> None:
    """``think`` as Ollama takes it: thinking needs a model whose thinking the server can
    split off (here: --reasoning-parser), and levels only gpt-oss's harmony format."""
    think = body.think
    if isinstance(think, str) and think not in THINK_LEVELS:
        raise OllamaError(400, f'invalid think value: "{think}" (must be "high", "medium", '
                               '"low", true, or false)')
    if ctx.reasoning_parser is None:
        if think is not None and think is not False:
            raise OllamaError(400, f'"{body.model}" does not support thinking')
    elif isinstance(think, str) and ctx.reasoning_parser != "openai_gptoss":
        raise OllamaError(400, f'think value "{think}" is not supported for this model')


def _refuse_unsupported(ctx: ServingContext, body: ChatRequest | GenerateRequest) -> None:
    model = body.model
    _check_think(ctx, body)
    if body.logprobs or body.top_logprobs:
        raise OllamaError(400, "logprobs: not supported by forerun's Ollama API (use "
                               "/v1/chat/completions with logprobs)")
    if isinstance(body, GenerateRequest):
        if body.images:
            raise OllamaError(400, "images: this model does not support images (forerun "
                                   "serves text-only models)")
        if body.suffix:
            raise OllamaError(400, f'suffix: "{model}" does not support insert')
        if body.template:
            raise OllamaError(400, "template: not supported: forerun renders the model's own "
                                   "Jinja chat template, not Ollama's Go templates")
        if body.raw and (body.system or body.context):
            raise OllamaError(400, "raw mode does not support template, system, or context")


def _tool_choice(ctx: ServingContext, body: ChatRequest) -> str | dict[str, Any] | None:
    """Ollama has no tool_choice. With --tool-call-parser the model decides (auto); without
    one a call is forced by structured output, except right after a tool's result, when the
    model answers in text (tools stay in the template). One tool is forced as that named
    function: the model writes only its arguments (a third of the tokens of the calls
    array), at the cost of one call per turn instead of several."""
    if not body.tools:
        return None
    if ctx.tool_config.enable_auto_tool_choice and ctx.tool_config.tool_call_parser:
        return "auto"
    last = body.messages[-1] if body.messages else {}
    if last.get("role") == "tool":
        return "none"
    if body.format not in (None, "", "null"):
        raise OllamaError(400, "format: cannot be combined with tools on this server: its "
                               "tool calls are forced by structured output (start forerun "
                               "serve with --enable-auto-tool-choice --tool-call-parser)")
    if len(body.tools) == 1:
        fn = body.tools[0].get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return {"type": "function", "function": {"name": fn["name"]}}
    return "required"


def _engine_request(ctx: ServingContext, body: ChatRequest | GenerateRequest,
                    options: dict[str, Any]) -> OllamaEngineRequest:
    fields: dict[str, Any] = {**sampling_fields(options), **format_fields(body.format)}
    if ctx.reasoning_parser is not None:
        fields.update(thinking_fields(ctx, body.think))
    if isinstance(body, ChatRequest):
        fields["messages"] = template_messages(body.messages)
        fields["tools"] = body.tools
        fields["tool_choice"] = _tool_choice(ctx, body)
    else:
        system = [{"role": "system", "content": body.system}] if body.system else []
        fields["messages"] = [*system, {"role": "user", "content": body.prompt}]
    try:
        return OllamaEngineRequest.model_validate(fields)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _prompt_ids(ctx: ServingContext, body: ChatRequest | GenerateRequest,
                req: OllamaEngineRequest, plan: ToolPlan) -> list[int]:
    if isinstance(body, GenerateRequest) and body.raw:
        try:
            return ctx.engine.processor.process_prompt(body.prompt).prompt_token_ids
        except ValueError as exc:
            raise APIError.bad_request(str(exc)) from None
    ids = chat_prompt_ids(ctx, req, plan)
    if isinstance(body, GenerateRequest) and body.context:
        ids = [*body.context, *ids]  # the earlier exchange, as Ollama prepends it
    return ids


def _max_tokens(ctx: ServingContext, options: dict[str, Any], n_prompt: int) -> int:
    """num_predict within the context: num_ctx (at most max_model_len) less the prompt."""
    limit = ctx.engine.max_model_len
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and num_ctx > limit:
        raise OllamaError(400, f"options.num_ctx: {num_ctx} is larger than this server's "
                               f"context of {limit} tokens (forerun serve --max-model-len)")
    window = limit if num_ctx is None or num_ctx <= 0 else num_ctx
    room = window - n_prompt
    if room < 1:
        where = "options.num_ctx" if num_ctx else "prompt"
        raise OllamaError(400, f"{where}: the prompt has {n_prompt} tokens, which leaves no "
                               f"room to generate in a context of {window} tokens")
    predict = options.get("num_predict", -1)
    return room if predict <= 0 else min(predict, room)  # Ollama: <= 0 means no limit


async def _generate(ctx: ServingContext, body: ChatRequest | GenerateRequest, request: Request,
                    t0: int, body_bytes: int, chat: bool) -> Response:
    _check_model(ctx, body.model)
    _refuse_unsupported(ctx, body)
    empty = not body.messages if isinstance(body, ChatRequest) else not body.prompt
    if empty:  # Ollama's "load the model" request: it is always loaded here
        reply: dict[str, Any] = {"model": body.model, "created_at": rfc3339(), "done": True,
                                 "done_reason": "load"}
        reply.update({"message": {"role": "assistant", "content": ""}} if chat
                     else {"response": ""})
        return JSONResponse(reply)
    options = parse_options(body.options)
    req = _engine_request(ctx, body, options)
    plan = plan_tools(ctx.tool_config, req, ctx.engine.tokenizer)
    # Templating and tokenising a big body run off the event loop, as on /v1.
    ids = await off_loop_if_big(body_bytes, _prompt_ids, ctx, body, req, plan)
    req = plan.adjust_request(req)
    rplan = plan_reasoning(ctx.reasoning_parser, req, ctx.engine.tokenizer,
                           ctx.structured_enable_in_reasoning)
    if rplan is not None:  # format (and forced calls) after the thinking, as on chat
        req = rplan.adjust_request(req, forced_calls=plan.schema is not None)
    max_tokens = _max_tokens(ctx, options, len(ids))
    _, engine_id = request_ids(request, "ollama")
    (stream,) = await start_requests(ctx, req, engine_id, [{"prompt_token_ids": ids}],
                                     max_tokens, None, body_bytes)
    timing = Timing(t0, time.perf_counter_ns())
    writer = ResponseWriter(body.model, chat, plan, timing, rplan)
    if body.stream is not False:  # Ollama streams unless told not to (null too)
        return StreamingResponse(writer.lines(stream), media_type="application/x-ndjson")
    try:
        last = await unless_disconnected(request, writer.whole(stream))
    except EngineDeadError as exc:
        raise OllamaError(503, f"the engine is not available: {exc}") from None
    return JSONResponse(last)
