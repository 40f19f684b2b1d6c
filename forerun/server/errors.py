"""OpenAI-shaped error bodies, and the exception handlers that produce them."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from forerun.engine.async_llm import EngineOverloadedError, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.server.bodies import ErrorBody, ErrorInfo, encode

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*)(?::|\s)")
# Processor errors name the engine's field; the client knows it by the API's name.
_PARAM_ALIASES = {"prompt_token_ids": "prompt"}


class APIError(Exception):
    """An error to return as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> APIError:
        return cls(400, message, "BadRequestError", param or param_of(message))


def param_of(message: str) -> str | None:
    """The field a ValueError message starts with (our convention), if any."""
    m = _FIELD.match(message)
    if m is None:
        return None
    return _PARAM_ALIASES.get(m.group(1), m.group(1))


def error_response(err: APIError) -> Response:
    body = ErrorBody(ErrorInfo(err.message, err.type, err.param, err.code))
    return Response(encode(body), status_code=err.status, media_type="application/json",
                    headers=err.headers)


def engine_dead_error(exc: BaseException) -> APIError:
    return APIError(503, f"the engine is not available: {exc}", "ServiceUnavailableError",
                    code="engine_dead")


def overloaded_error(exc: EngineOverloadedError) -> APIError:
    return APIError(503, str(exc), "ServiceUnavailableError", code=exc.code,
                    headers={"Retry-After": str(exc.retry_after_s)})


def timeout_error(exc: RequestTimeoutError) -> APIError:
    return APIError(504, str(exc), "TimeoutError", code="request_timeout")


# The names pydantic gives the members of a union in an error's location ("str",
# "list[int]", "function-after[...]"), matched whole: a field may start the same ("stream").
_UNION_MEMBER = re.compile(r"^(?:(?:str|int|float|bool|list|dict|tuple|set|none)(?:\[.*\])?"
                           r"|(?:function|constrained|json-or-python|nullable)-.*)$")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError.bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        msg = f"invalid JSON body: {first.get('msg', '')}"
        if "hex escape" in msg:
            # pydantic's JSON parser says no more than this about a lone surrogate.
            msg += " (a lone UTF-16 surrogate such as \\ud800 is not text)"
        return APIError(400, msg, "BadRequestError")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    # Skip the union-member names pydantic adds, e.g. ('prompt', 'list[int]', 0).
    fields = [p for p in loc if not _UNION_MEMBER.match(p)]
    # Only our own ValueErrors start with a field name ("Input should be ..." does not).
    param = fields[0] if fields else (
        param_of(msg) if first.get("type") == "value_error" else None)
    if param and len(loc) > 1 and _UNION_MEMBER.match(loc[1]):
        # A union fails once per member, and the first member's complaint alone misleads
        # ("should be a valid string" for [true, false]): list what would have been valid.
        members: list[str] = []
        for e in errors:
            where = [str(p) for p in e.get("loc", ()) if p != "body"]
            if (len(where) > 1 and where[0] == param and _UNION_MEMBER.match(where[1])
                    and where[1] not in members):
                members.append(where[1])
        if len(members) > 1:
            msg = f"must be one of {', '.join(members)}"
    kind = str(first.get("type", ""))
    if kind and kind != "value_error" and not msg.startswith("must be one of"):
        # pydantic's error type, as vLLM's message carries it: clients match on it.
        msg = f"{msg} [type={kind}]"
    if param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    # Not bad_request: its guess from the message would make "Input" the param.
    return APIError(400, msg, "BadRequestError", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return error_response(_validation_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(engine_dead_error(exc))

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(_: Request, exc: EngineOverloadedError) -> Response:
        return error_response(overloaded_error(exc))

    @app.exception_handler(RequestTimeoutError)
    async def _timeout(_: Request, exc: RequestTimeoutError) -> Response:
        return error_response(timeout_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, str(exc.detail), "invalid_request_error",
                                       code=code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {exc}", "InternalServerError"))
