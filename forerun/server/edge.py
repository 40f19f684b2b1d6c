"""The HTTP edge: what is checked before a body is read, how bodies are read, disconnects.

``EdgeGuard`` is plain ASGI so it runs before FastAPI touches the body: a wrong API key or
a declared ``Content-Length`` over the limit is refused without reading a byte of it.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from forerun.server.config import OFFLOAD_BODY_BYTES
from forerun.server.errors import APIError, error_response

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {limit} "
                         "bytes (--max-request-body-bytes)", "RequestTooLargeError",
                    code="request_too_large")


class EdgeGuard:
    """ASGI middleware: API key on ``/v1`` and ``/api/`` routes and the declared body size, body unread."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        error = None
        # /api: Ollama's routes (forerun/server/ollama.py) generate too.
        if self.api_key is not None and route_path(scope).startswith(("/v1", "/api/")) \
                and not self._key_matches(headers):
            error = APIError(401, "Incorrect API key provided.", "AuthenticationError",
                             code="invalid_api_key")
        if error is None:
            length = headers.get(b"content-length")
            try:
                too_big = length is not None and int(length) > self.max_body_bytes
            except ValueError:
                too_big = False  # the HTTP server itself rejects a malformed length
            if too_big:
                error = _too_large(self.max_body_bytes)
        if error is None:
            await self.app(scope, receive, send)
            return
        response = _shaped_error(scope, error)
        # The body was not read: close the connection rather than drain it.
        response.headers["connection"] = "close"
        await response(scope, receive, send)


    def _key_matches(self, headers: dict[bytes, bytes]) -> bool:
        """The key as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key:
        <key>`` (Anthropic's API); either one matching lets the request through."""
        assert self.api_key is not None
        key = self.api_key.encode()
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode("latin-1"), key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), key)


def set_error_shape(app: Any, prefix: str, render: Callable[[APIError], Any]) -> None:
    """Errors the edge answers on ``prefix`` and below take ``render``'s shape (an API
    whose error body is not OpenAI's, such as Anthropic's)."""
    shapes = getattr(app.state, "error_shapes", None)
    if shapes is None:
        shapes = app.state.error_shapes = {}
    shapes[prefix] = render


def _shaped_error(scope: Scope, error: APIError) -> Any:
    app = scope.get("app")
    shapes = getattr(getattr(app, "state", None), "error_shapes", None) or {}
    path = route_path(scope)
    for prefix, render in shapes.items():
        if path == prefix or path.startswith(prefix + "/"):
            return render(error)
    return error_response(error)


def route_path(scope: Scope) -> str:
    """The path the routes see: with ``--root-path`` a request may carry the prefix."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


class RequestIdHeaders:
    """ASGI middleware: every response carries ``X-Request-Id``, the client's or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = b""
        for name, value in scope.get("headers") or []:
            if name == b"x-request-id":
                rid = value
                break
        if not rid:
            rid = uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ServerLoad:
    """Requests in flight on the tracked routes; read by ``GET /load``."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadTracker:
    """ASGI middleware: counts requests on ``paths`` in flight into ``load``.

    A streamed response counts until its last byte is sent, as in vLLM.
    """

    def __init__(self, app: ASGIApp, paths: frozenset[str], load: ServerLoad) -> None:
        self.app = app
        self.paths = paths
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as a chunked one passes ``limit``."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected from None
    return b"".join(chunks)


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON body into ``model``; errors become FastAPI's validation error."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def off_loop_if_big(size: int, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on a worker thread when the body is big, else inline (cheaper)."""
    if size >= OFFLOAD_BODY_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class ClientDisconnected(Exception):
    """The client hung up before its response was ready; its requests were aborted."""


async def _disconnected(request: Request) -> None:
    # After the body is read, receive() returns only when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await ``work``, cancelling it (which aborts its requests) if the client hangs up."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        try:
            await task
        except BaseException:  # noqa: BLE001 - cancelled on purpose; its finally aborted
            pass
        raise ClientDisconnected
    return task.result()
