"""``forerun disagg-proxy``: send each request to a prefill instance, then to a decode one.

Prefill/decode disaggregation (docs/kv_connector.md): two ``forerun serve`` instances run
with ``--kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": ...}'``, one as
``kv_producer`` and one as ``kv_consumer``. For every completion or chat request this proxy

1. sends a copy to a prefill instance with ``max_tokens`` 1, no streaming and
   ``kv_transfer_params: {"do_remote_decode": true}``: the producer computes the prompt's
   KV, answers with the ``kv_transfer_params`` that say where its blocks can be read, and
   keeps the blocks until they are read (or a timeout passes);
2. sends the original request with those ``kv_transfer_params`` to a decode instance, whose
   connector pulls the blocks before the request runs, and passes its answer (streamed or
   not) back to the client unchanged.

This is vLLM's disaggregated-serving proxy shape: the instances speak the ordinary OpenAI
API, and only ``kv_transfer_params`` is added. Instances are used round robin.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Fields that would make the one-token prefill call fail or stream: dropped from its copy.
_PREFILL_DROPS = ("stream_options", "min_tokens", "max_completion_tokens", "stop")


@dataclass(slots=True)
class ProxyConfig:
    """Where the prefill and decode instances listen (base URLs, e.g. http://host:8100)."""

    prefill_urls: list[str]
    decode_urls: list[str]
    timeout_s: float = 600.0
    _prefill_cycle: Any = field(default=None, repr=False)
    _decode_cycle: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("disagg-proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in self.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in self.decode_urls]
        self._prefill_cycle = itertools.cycle(self.prefill_urls)
        self._decode_cycle = itertools.cycle(self.decode_urls)

    def next_prefill(self) -> str:
        return next(self._prefill_cycle)

    def next_decode(self) -> str:
        return next(self._decode_cycle)


def _error(status: int, message: str, param: str | None = None,
           type_: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": status}}, status_code=status)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The copy of a request that a prefill instance computes: one token, not streamed."""
    out = copy.deepcopy(body)
    for name in _PREFILL_DROPS:
        out.pop(name, None)
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def _forward_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "x-api-key", "x-request-id")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    """The proxy's FastAPI app (its routes are the two generation routes, models, health)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=10.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="forerun disagg-proxy", lifespan=lifespan)

    async def generate(request: Request, route: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if body.get("n", 1) not in (1, None):
            return _error(400, "n: disaggregated serving returns one choice per request",
                          "n")
        if body.get("kv_transfer_params") is not None:
            return _error(400, "kv_transfer_params: set by the proxy, not by clients",
                          "kv_transfer_params")
        headers = _forward_headers(request)
        prefill = config.next_prefill()
        try:
            first = await client.post(prefill + route, json=prefill_body(body),
                                      headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s failed: %s", prefill, e)
            return _error(503, f"the prefill instance {prefill} did not answer: "
                               f"{type(e).__name__}", type_="ServiceUnavailableError")
        if first.status_code != 200:
            # The client's own mistake (a 400 naming a field) reads the same as from one server.
            return Response(first.content, status_code=first.status_code,
                            media_type=first.headers.get("content-type"))
        params = first.json().get("kv_transfer_params")
        if not params:
            return _error(502, f"the prefill instance {prefill} returned no "
                               "kv_transfer_params: is it started with a kv_producer "
                               "--kv-transfer-config?", type_="BadGatewayError")
        decode = config.next_decode()
        second = dict(body, kv_transfer_params=params)
        stream = bool(body.get("stream"))
        try:
            req = client.build_request("POST", decode + route, json=second, headers=headers)
            resp = await client.send(req, stream=stream)
        except httpx.HTTPError as e:
            logger.warning("decode instance %s failed: %s", decode, e)
            return _error(503, f"the decode instance {decode} did not answer: "
                               f"{type(e).__name__}", type_="ServiceUnavailableError")
        if not stream:
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(chunks(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            r = await client.get(config.decode_urls[0] + "/v1/models",
                                 headers=_forward_headers(request))
        except httpx.HTTPError as e:
            return _error(503, f"the decode instance did not answer: {type(e).__name__}",
                          type_="ServiceUnavailableError")
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        down = []
        for url in config.prefill_urls + config.decode_urls:
            try:
                ok = (await client.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        if down:
            return _error(503, f"instances not healthy: {', '.join(down)}",
                          type_="ServiceUnavailableError")
        return Response(status_code=200)

    return app


def add_disagg_proxy_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``forerun disagg-proxy``."""
    p = subparsers.add_parser(
        "disagg-proxy", help="route requests to a prefill and then a decode instance",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="base URLs of kv_producer instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="base URLs of kv_consumer instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one upstream call may take")
    p.set_defaults(func=run_disagg_proxy)
    return p


def run_disagg_proxy(args: argparse.Namespace) -> int:
    config = ProxyConfig(args.prefill, args.decode, args.timeout)
    logger.info("disagg-proxy on %s:%d: prefill %s, decode %s", args.host, args.port,
                config.prefill_urls, config.decode_urls)
    uvicorn.run(build_proxy_app(config), host=args.host, port=args.port, log_level="warning")
    return 0
