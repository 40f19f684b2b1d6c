"""The FastAPI application: OpenAI-compatible routes plus health, version and metrics."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import forerun
from forerun.engine.async_llm import AsyncLLM
from forerun.engine.processor import ProcessedPrompt
from forerun.sampling_params import SamplingParams
from forerun.server.anthropic import register_anthropic_routes
from forerun.server.bodies import ModelCard, ModelList, encode
from forerun.server.chat import create_chat_completion
from forerun.server.chat_batch import BatchChatCompletionRequest, create_batch_chat_completion
from forerun.server.completions import create_completion
from forerun.server.config import ServerConfig
from forerun.server.edge import (
    ClientDisconnected,
    EdgeGuard,
    LoadTracker,
    RequestIdHeaders,
    ServerLoad,
    off_loop_if_big,
    parse_body,
    read_body,
)
from forerun.server.embeddings import add_pooling_routes
from forerun.server.errors import APIError, install_error_handlers
from forerun.server.metrics import ServerMetrics
from forerun.server.ollama import register_ollama_routes
from forerun.server.protocol import ChatCompletionRequest, CompletionRequest
from forerun.server.responses_api import create_response
from forerun.server.responses_protocol import ResponsesRequest
from forerun.server.serving import ServingContext, now_s
from forerun.server.tokenize import (
    DetokenizeRequest,
    TokenizeCompletionRequest,
    detokenize,
    parse_tokenize,
    tokenize,
    tokenizer_info,
)
from forerun.server.tool_calls import ToolCallConfig
from forerun.server.web import register_web_page

logger = logging.getLogger(__name__)
# Its own logger, so request lines can be filtered or silenced apart from the rest.
request_log = logging.getLogger("forerun.server.requests")

_REF = "#/components/schemas/{model}"


def build_app(engine: AsyncLLM, model_name: str, server: ServerConfig | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """An app serving ``engine``; its lifespan shuts the engine down on exit."""
    server = server or ServerConfig()
    metrics = metrics or ServerMetrics(model_name)
    if engine.observer is None:
        engine.observer = metrics
    names = server.served_model_names or (model_name,)
    load = ServerLoad()
    ctx = ServingContext(engine, model_name, served_model_names=names,
                         on_request=_request_hook(metrics, server.log_requests),
                         force_include_usage=server.enable_force_include_usage,
                         return_tokens_as_token_ids=server.return_tokens_as_token_ids,
                         tool_config=ToolCallConfig(server.enable_auto_tool_choice,
                                                    server.tool_call_parser),
                         chat_template=server.chat_template,
                         disable_any_whitespace=server.structured_outputs_disable_any_whitespace,
                         reasoning_parser=server.reasoning_parser,
                         structured_enable_in_reasoning=(
                             server.structured_outputs_enable_in_reasoning))
    created = now_s()
    limit = server.max_request_body_bytes

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()  # read heartbeats from the start, not from the first request
        yield
        await engine.shutdown_async()

    docs: dict[str, Any] = {}
    if server.disable_fastapi_docs:
        docs = {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="forerun", version=forerun.__version__, lifespan=lifespan,
                  root_path=server.root_path, **docs)
    install_error_handlers(app)
    # The last added runs first: request ids are put on every reply, refusals included;
    # load counts only requests that EdgeGuard let through.
    if server.enable_server_load_tracking:
        app.add_middleware(LoadTracker, paths=_LOAD_TRACKED, load=load)
    # API key and declared size are checked by EdgeGuard before any body is read.
    app.add_middleware(EdgeGuard, api_key=server.api_key, max_body_bytes=limit)
    if server.enable_request_id_headers:
        app.add_middleware(RequestIdHeaders)

    async def generate(request: Request, raw: bytes | None = None,
                       chat: bool = False, responses: bool = False,
                       batch: bool = False) -> Response:
        """Read, parse and run one completion, chat, batched chat or Responses request."""
        try:
            if raw is None:
                raw = await read_body(request, limit)
            if batch:
                bbody = await off_loop_if_big(len(raw), parse_body, BatchChatCompletionRequest,
                                              raw)
                return await create_batch_chat_completion(ctx, bbody, request, len(raw))
            if responses:
                rbody = await off_loop_if_big(len(raw), parse_body, ResponsesRequest, raw)
                return await create_response(ctx, rbody, request, len(raw))
            if chat:
                body = await off_loop_if_big(len(raw), parse_body, ChatCompletionRequest, raw)
                return await create_chat_completion(ctx, body, request, len(raw))
            cbody = await off_loop_if_big(len(raw), parse_body, CompletionRequest, raw)
            return await create_completion(ctx, cbody, request, len(raw))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nothing to log

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(request)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.post("/v1/chat/completions/batch",
              openapi_extra=_json_body(BatchChatCompletionRequest))
    async def batch_chat_completions(request: Request) -> Response:
        return await generate(request, batch=True)

    @app.post("/v1/responses", openapi_extra=_json_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        return await generate(request, responses=True)

    register_anthropic_routes(app, ctx, limit)  # /v1/messages: Anthropic's Messages API

    @app.post("/invocations", openapi_extra=_json_body(ChatCompletionRequest))
    async def invocations(request: Request) -> Response:
        """SageMaker's single route: chat when the body has messages, else completions."""
        try:
            raw = await read_body(request, limit)
        except ClientDisconnected:
            return Response(status_code=499)
        return await generate(request, raw, chat=_invocation_kind(raw) is ChatCompletionRequest)

    async def tokenizer_route(request: Request, parse: Any, handle: Any) -> Response:
        """Read, parse (``parse(raw)``) and answer (``handle(ctx, body)``) one body."""
        try:
            raw = await read_body(request, limit)
        except ClientDisconnected:
            return Response(status_code=499)
        body = await off_loop_if_big(len(raw), parse, raw)
        return JSONResponse(await off_loop_if_big(len(raw), handle, ctx, body))

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeCompletionRequest))
    async def tokenize_route(request: Request) -> Response:
        return await tokenizer_route(request, parse_tokenize, tokenize)

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        return await tokenizer_route(
            request, lambda raw: parse_body(DetokenizeRequest, raw), detokenize)

    if server.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info_route() -> Response:
            return JSONResponse(tokenizer_info(ctx))

    add_pooling_routes(app, ctx, limit)  # /v1/embeddings, /score, /rerank

    @app.get("/load")
    async def server_load() -> Response:
        # Without --enable-server-load-tracking nothing counts, and this stays 0 (vLLM).
        return JSONResponse({"server_load": load.in_flight})

    register_ollama_routes(app, ctx, limit)  # Ollama's /api/* (forerun/server/ollama.py)

    _add_body_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                            TokenizeCompletionRequest, DetokenizeRequest])

    @app.get("/v1/models")
    async def models() -> Response:
        # One card per served name, each rooted at the same model (as vLLM lists them).
        root = str(engine.model_info.source.name)
        cards = [ModelCard(name, created, engine.max_model_len, root=root) for name in names]
        return Response(encode(ModelList(cards)), media_type="application/json")

    # Load balancers probe with HEAD; it answers as GET does (the server sends no body).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        problem = engine.health()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        if engine.draining is not None:
            return JSONResponse({"status": "draining", "error": engine.draining},
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": forerun.__version__})

    register_web_page(app, engine, metrics, names[0], enabled=not server.disable_web_page)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.health() is None:
            try:
                metrics.update_engine_stats(await engine.get_engine_stats(timeout_s=5.0))
            except (TimeoutError, RuntimeError) as exc:
                logger.warning("could not refresh engine stats: %s", exc)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


# Generation routes: what --enable-server-load-tracking counts.
_LOAD_TRACKED = frozenset({"/v1/completions", "/v1/chat/completions",
                           "/v1/chat/completions/batch", "/v1/responses", "/invocations",
                           "/v1/messages"})


def _invocation_kind(raw: bytes) -> type[BaseModel]:
    """Which request an /invocations body is: chat with ``messages``, completion with
    ``prompt``; anything else is a 400, as in vLLM."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError.bad_request("the body is not valid JSON") from None
    if isinstance(data, dict):
        if "messages" in data:
            return ChatCompletionRequest
        if "prompt" in data:
            return CompletionRequest
    raise APIError.bad_request(
        "Cannot find suitable handler for request. Expected one of: a chat completion "
        "request (with 'messages'), a completion request (with 'prompt')")


def _request_hook(metrics: ServerMetrics, log_requests: bool
                  ) -> Callable[[str, ProcessedPrompt, SamplingParams], None]:
    """Called for each request queued: its parameters to the metrics, one log line."""

    def on_request(request_id: str, processed: ProcessedPrompt,
                   params: SamplingParams) -> None:
        metrics.on_request(params)
        if log_requests:
            # Sizes and the main knobs only: cheap, and no prompt text in the logs.
            request_log.info(
                "Received request %s: prompt_tokens=%d n=%d max_tokens=%s temperature=%s "
                "top_p=%s seed=%s", request_id, len(processed.prompt_token_ids), params.n,
                params.max_tokens, params.temperature, params.top_p, params.seed)

    return on_request


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its JSON itself (see read_body)."""
    schema = model.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)  # published under components by _add_body_schemas
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


def _add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the nested models of hand-read bodies under ``components/schemas``."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in models:
                comps.update(m.model_json_schema(ref_template=_REF).get("$defs", {}))
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
