"""The FastAPI application: OpenAI-compatible routes plus health, version and metrics."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import forerun
from forerun.engine.async_llm import AsyncLLM
from forerun.server.chat import create_chat_completion
from forerun.server.completions import create_completion
from forerun.server.errors import APIError, install_error_handlers
from forerun.server.metrics import ServerMetrics
from forerun.server.protocol import ChatCompletionRequest, CompletionRequest
from forerun.server.responses import ModelCard, ModelList, encode
from forerun.server.serving import ServingContext, now_s

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """An app serving ``engine``; its lifespan shuts the engine down on exit."""
    metrics = metrics or ServerMetrics(model_name)
    if engine.observer is None:
        engine.observer = metrics
    ctx = ServingContext(engine, model_name)
    created = now_s()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown_async()

    app = FastAPI(title="forerun", version=forerun.__version__, lifespan=lifespan)
    install_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
            raise APIError(401, "Incorrect API key provided.", "AuthenticationError",
                           code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest) -> Response:
        return await create_completion(ctx, body)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        return await create_chat_completion(ctx, body)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        card = ModelCard(model_name, created, engine.max_model_len,
                         root=str(engine.model_info.source.name))
        return Response(encode(ModelList([card])), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return JSONResponse({"status": "engine dead", "error": engine.dead_error},
                                status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": forerun.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not engine.is_dead:
            try:
                metrics.update_engine_stats(await engine.get_stats(timeout_s=5.0))
            except (TimeoutError, RuntimeError) as exc:
                logger.warning("could not refresh engine stats: %s", exc)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
