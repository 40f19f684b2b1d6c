"""The FastAPI application: OpenAI-compatible routes plus health, version and metrics."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import forerun
from forerun.engine.async_llm import AsyncLLM
from forerun.server.chat import create_chat_completion
from forerun.server.completions import create_completion
from forerun.server.config import ServerConfig
from forerun.server.edge import (
    ClientDisconnected,
    EdgeGuard,
    off_loop_if_big,
    parse_body,
    read_body,
)
from forerun.server.errors import install_error_handlers
from forerun.server.metrics import ServerMetrics
from forerun.server.protocol import ChatCompletionRequest, CompletionRequest
from forerun.server.responses import ModelCard, ModelList, encode
from forerun.server.serving import ServingContext, now_s

logger = logging.getLogger(__name__)

_REF = "#/components/schemas/{model}"


def build_app(engine: AsyncLLM, model_name: str, server: ServerConfig | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """An app serving ``engine``; its lifespan shuts the engine down on exit."""
    server = server or ServerConfig()
    metrics = metrics or ServerMetrics(model_name)
    if engine.observer is None:
        engine.observer = metrics
    ctx = ServingContext(engine, model_name,
                         force_include_usage=server.enable_force_include_usage)
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
    app = FastAPI(title="forerun", version=forerun.__version__, lifespan=lifespan, **docs)
    install_error_handlers(app)
    # API key and declared size are checked by EdgeGuard before any body is read.
    app.add_middleware(EdgeGuard, api_key=server.api_key, max_body_bytes=limit)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        try:
            raw = await read_body(request, limit)
            body = await off_loop_if_big(len(raw), parse_body, CompletionRequest, raw)
            return await create_completion(ctx, body, request, len(raw))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nothing to log

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        try:
            raw = await read_body(request, limit)
            body = await off_loop_if_big(len(raw), parse_body, ChatCompletionRequest, raw)
            return await create_chat_completion(ctx, body, request, len(raw))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nothing to log

    _add_body_schemas(app, [CompletionRequest, ChatCompletionRequest])

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(model_name, created, engine.max_model_len,
                         root=str(engine.model_info.source.name))
        return Response(encode(ModelList([card])), media_type="application/json")

    @app.get("/health")
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

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if engine.health() is None:
            try:
                metrics.update_engine_stats(await engine.get_stats(timeout_s=5.0))
            except (TimeoutError, RuntimeError) as exc:
                logger.warning("could not refresh engine stats: %s", exc)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


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
