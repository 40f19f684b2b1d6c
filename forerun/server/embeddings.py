"""``/v1/embeddings``, ``/score`` and ``/rerank``: the pooling routes, over ``AsyncLLM.encode``.

Embeddings have OpenAI's shape (``encoding_format`` float, or base64 of little-endian
float32 as OpenAI's client decodes it); ``/score`` and ``/v1/score`` vLLM's (``text_1``,
``text_2``); ``/rerank`` and ``/v1/rerank`` Jina's and Cohere's (``query``, ``documents``,
``top_n``, ``return_documents``). Scores are the cosine similarity of the two texts'
embeddings. The routes work on a ``--runner pooling`` server and on a generating one alike
(the same engine path). :func:`embed_texts` is the call other protocols (Ollama's
``/api/embed``) make.
"""

from __future__ import annotations

import asyncio
import base64
import re
import struct
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from forerun.engine.async_llm import AsyncLLM, RequestStream
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import PoolingRequestOutput
from forerun.pooling_params import PoolingParams
from forerun.scoring import as_text_list, cosine, pair_texts
from forerun.server.edge import (
    ClientDisconnected,
    off_loop_if_big,
    parse_body,
    read_body,
    unless_disconnected,
)
from forerun.server.errors import APIError, engine_dead_error
from forerun.server.serving import ServingContext, check_model, now_s

# Unknown fields are ignored (vLLM's and OpenAI's clients send extras); types are strict.
_CONFIG = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

# The processor's errors name the prompt; the routes' own fields are input, text_1, ...
_PROMPT_FIELD = re.compile(r"^(prompt_token_ids|prompt)\b")

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's fields, plus vLLM's ``truncate_prompt_tokens``
    and ``normalize``)."""

    model_config = _CONFIG

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class ScoreRequest(BaseModel):
    """``POST /score`` (vLLM's shape): one text_1 against each text_2, or pairwise."""

    model_config = _CONFIG

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(BaseModel):
    """``POST /rerank`` (Jina's and Cohere's shape)."""

    model_config = _CONFIG

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


def _input_prompts(value: EmbeddingInput) -> list[str | dict[str, Any]]:
    """OpenAI's four input forms as engine prompts."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError.bad_request("input: must not be empty", "input")
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": value}]
    return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]


def _as_input_error(exc: ValueError, where: str) -> APIError:
    """A processor error ("prompt: ...") renamed to the route's own field (``where``,
    e.g. ``input[2]``)."""
    msg = str(exc)
    m = _PROMPT_FIELD.match(msg)
    if m is None:
        return APIError.bad_request(msg)
    return APIError.bad_request(where + msg[m.end(1):], where.split("[")[0])


def _names(field: str, n: int) -> list[str]:
    return [field] if n == 1 else [f"{field}[{i}]" for i in range(n)]


async def encode_prompts(engine: AsyncLLM, prompts: Sequence[str | dict[str, Any]],
                         params: PoolingParams, base_id: str,
                         names: Sequence[str] | None = None,
                         request: Request | None = None) -> list[PoolingRequestOutput]:
    """Pool every prompt; a bad one (a 400 naming its field, ``names[i]``, default
    ``input[i]``) queues nothing.

    Every request is aborted if this is cancelled (or the client of ``request`` leaves).
    """
    names = list(names) if names is not None else _names("input", len(prompts))
    try:
        engine.check_admission(len(prompts))
    except ValueError as exc:
        raise APIError.bad_request(str(exc), names[0].split("[")[0]) from None
    processed = []
    for p, where in zip(prompts, names, strict=True):
        try:
            processed.append(engine.process_pooling(p, params))
        except ValueError as exc:
            raise _as_input_error(exc, where) from None
    streams: list[RequestStream] = []
    try:
        for i, (pp, rp) in enumerate(processed):
            streams.append(engine.add_processed_pooling_request(f"{base_id}-{i}", pp, rp))
        work = asyncio.gather(*(_last(s) for s in streams))
        outs = await (unless_disconnected(request, work) if request is not None else work)
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    finally:
        for s in streams:
            s.abort()
    for out in outs:
        if out.finish_reason != "stop":
            raise APIError(500, f"the pooling request ended with {out.finish_reason!r}",
                           "InternalServerError")
    return outs


async def _last(stream: RequestStream) -> PoolingRequestOutput:
    last = None
    async for item in stream:  # one item: pooling requests report only their end
        last = item
    assert isinstance(last, PoolingRequestOutput)
    return last


async def embed_texts(engine: AsyncLLM, texts: Sequence[str | list[int]],
                      dimensions: int | None = None, normalize: bool | None = None,
                      truncate_prompt_tokens: int | None = None) -> list[list[float]]:
    """One embedding per text (or token-id list), in order: what another protocol's
    embedding route calls. Raises APIError (400 naming ``input``) on bad input."""
    params = _params(dimensions, normalize, truncate_prompt_tokens)
    prompts = [t if isinstance(t, str) else {"prompt_token_ids": t} for t in texts]
    outs = await encode_prompts(engine, prompts, params, f"embd-{uuid.uuid4().hex}")
    return [o.outputs.data for o in outs]


def _params(dimensions: int | None, normalize: bool | None,
            truncate_prompt_tokens: int | None) -> PoolingParams:
    try:
        return PoolingParams(dimensions=dimensions, normalize=normalize,
                             truncate_prompt_tokens=truncate_prompt_tokens)
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None


def _base64(vec: list[float]) -> str:
    """Little-endian float32, base64: what OpenAI's client decodes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")


def _usage(outs: Sequence[PoolingRequestOutput]) -> dict[str, int]:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n}


async def create_embedding(ctx: ServingContext, body: EmbeddingRequest,
                           request: Request) -> dict[str, Any]:
    check_model(ctx, body.model)
    params = _params(body.dimensions, body.normalize, body.truncate_prompt_tokens)
    rid = f"embd-{uuid.uuid4().hex}"
    outs = await encode_prompts(ctx.engine, _input_prompts(body.input), params, rid,
                                request=request)
    data = [{"object": "embedding", "index": i,
             "embedding": _base64(o.outputs.data) if body.encoding_format == "base64"
             else o.outputs.data} for i, o in enumerate(outs)]
    return {"id": rid, "object": "list", "created": now_s(), "model": ctx.model_name,
            "data": data, "usage": _usage(outs)}


async def _scores(ctx: ServingContext, firsts: list[str], seconds: list[str],
                  pairs: list[tuple[int, int]], truncate: int | None, rid: str,
                  request: Request, names: list[str]) -> tuple[list[float], dict[str, int]]:
    """Cosine of each (first, second) index pair; every text embedded once."""
    params = _params(None, None, truncate)
    outs = await encode_prompts(ctx.engine, [*firsts, *seconds], params, rid, names,
                                request)
    a, b = outs[: len(firsts)], outs[len(firsts):]
    return [cosine(a[i].outputs.data, b[j].outputs.data) for i, j in pairs], _usage(outs)


async def create_score(ctx: ServingContext, body: ScoreRequest,
                       request: Request) -> dict[str, Any]:
    check_model(ctx, body.model)
    try:
        pairs = pair_texts(body.text_1, body.text_2)
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    firsts = list(dict.fromkeys(p[0] for p in pairs))
    where = {t: i for i, t in enumerate(firsts)}
    rid = f"score-{uuid.uuid4().hex}"
    scores, usage = await _scores(ctx, firsts, [p[1] for p in pairs],
                                  [(where[p[0]], j) for j, p in enumerate(pairs)],
                                  body.truncate_prompt_tokens, rid, request,
                                  _names("text_1", len(firsts))
                                  + _names("text_2", len(pairs)))
    return {"id": rid, "object": "list", "created": now_s(), "model": ctx.model_name,
            "data": [{"index": i, "object": "score", "score": s}
                     for i, s in enumerate(scores)], "usage": usage}


async def create_rerank(ctx: ServingContext, body: RerankRequest,
                        request: Request) -> dict[str, Any]:
    check_model(ctx, body.model)
    try:
        as_text_list("query", body.query)
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    if body.top_n is not None and body.top_n < 0:
        raise APIError.bad_request(f"top_n must be at least 0, got {body.top_n}", "top_n")
    rid = f"rerank-{uuid.uuid4().hex}"
    scores, usage = await _scores(ctx, [body.query], body.documents,
                                  [(0, j) for j in range(len(body.documents))],
                                  body.truncate_prompt_tokens, rid, request,
                                  ["query", *_names("documents", len(body.documents))])
    order = sorted(range(len(scores)), key=lambda j: -scores[j])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for j in order:
        item: dict[str, Any] = {"index": j, "relevance_score": scores[j]}
        if body.return_documents:
            item["document"] = {"text": body.documents[j]}
        results.append(item)
    return {"id": rid, "model": ctx.model_name, "usage": usage, "results": results}


def add_pooling_routes(app: FastAPI, ctx: ServingContext, body_limit: int) -> None:
    """Register the embedding, score and rerank routes on ``app`` (one call in build_app)."""

    async def run(request: Request, model: type[BaseModel], handle: Any) -> Response:
        try:
            raw = await read_body(request, body_limit)
            body = await off_loop_if_big(len(raw), parse_body, model, raw)
            return JSONResponse(await handle(ctx, body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await run(request, EmbeddingRequest, create_embedding)

    for path in ("/score", "/v1/score"):
        @app.post(path)
        async def score(request: Request) -> Response:
            return await run(request, ScoreRequest, create_score)

    for path in ("/rerank", "/v1/rerank"):
        @app.post(path)
        async def rerank(request: Request) -> Response:
            return await run(request, RerankRequest, create_rerank)
