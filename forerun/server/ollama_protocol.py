"""Ollama's ``/api/*`` request bodies, and how their ``options`` map onto the fields of
forerun's OpenAI request (``ChatCompletionRequest``), whose ``sampling_params`` the engine
then takes.

Ollama reads bodies with Go's JSON decoder: unknown fields are ignored, and so are unknown
``options`` (Ollama logs "invalid option provided"); a known option of the wrong type is an
error. Here each error is a 400 naming the field (``options.temperature: ...``).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from forerun.server.errors import APIError
from forerun.server.protocol import ChatCompletionRequest, TextCheckedRequest

logger = logging.getLogger(__name__)

# Strict as the OpenAI bodies are (true is not 1, "5" is not 5); unknown fields ignored.
_BODY = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# Ollama's sampling options -> the OpenAI request field each one sets.
_SAMPLING: dict[str, str] = {
    "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
}
_INT_OPTIONS = frozenset({"top_k", "seed", "num_predict", "num_ctx", "num_keep",
                          "repeat_last_n", "num_batch", "num_gpu", "main_gpu", "num_thread",
                          "draft_num_predict"})
_FLOAT_OPTIONS = frozenset({"temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
                            "presence_penalty", "frequency_penalty"})
_BOOL_OPTIONS = frozenset({"use_mmap"})
# Options Ollama knows that change nothing here: how a model is loaded (forerun serve's flags
# decide that) and repeat_last_n (penalties look at the whole sequence, as in vLLM).
_IGNORED = frozenset({"num_keep", "repeat_last_n", "num_batch", "num_gpu", "main_gpu",
                      "num_thread", "use_mmap", "draft_num_predict"})
# Ollama's defaults for what a request leaves out (api.DefaultOptions); seed -1 is random.
_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# What the engine's ValueErrors call a field -> the option the client set.
_ENGINE_NAMES: dict[str, str] = {
    **{v: f"options.{k}" for k, v in _SAMPLING.items()},
    "max_tokens": "options.num_predict", "structured_outputs": "format",
    "response_format": "format",
}


class OllamaError(Exception):
    """An error answered as Ollama answers it: ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class OllamaEngineRequest(ChatCompletionRequest):
    """The OpenAI chat request an Ollama body becomes; engine errors name Ollama's fields."""

    engine_field_names: ClassVar[dict[str, str]] = _ENGINE_NAMES


class _OllamaBody(TextCheckedRequest):
    model_config = _BODY

    model: str = ""
    stream: bool | None = None  # null or absent: stream (Go's *bool)
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    # Accepted and ignored: forerun keeps its one model loaded for as long as it runs.
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateRequest(_OllamaBody):
    """``POST /api/generate``."""

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class ChatRequest(_OllamaBody):
    """``POST /api/chat``."""

    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None


class ShowRequest(BaseModel):
    """``POST /api/show`` (Ollama's older clients send ``name``)."""

    model_config = _BODY

    model: str = ""
    name: str = ""
    verbose: bool = False


class EmbedRequest(BaseModel):
    """``POST /api/embed`` (``input``) and ``/api/embeddings`` (``prompt``)."""

    model_config = _BODY

    model: str = ""
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


def _typed(name: str, value: Any) -> Any:
    """An option's value as Ollama's FromMap takes it (a JSON float is a valid integer)."""
    where = f"options.{name}"
    if name in _INT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise APIError.bad_request(f"{where}: must be of type integer", where)
        if isinstance(value, float) and not value.is_integer():
            raise APIError.bad_request(f"{where}: must be of type integer, got {value}", where)
        return int(value)
    if name in _FLOAT_OPTIONS:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise APIError.bad_request(f"{where}: must be of type float", where)
        return float(value)
    if name in _BOOL_OPTIONS:
        if not isinstance(value, bool):
            raise APIError.bad_request(f"{where}: must be of type boolean", where)
        return value
    if name == "stop":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise APIError.bad_request(f"{where}: must be of type array of strings", where)
        return list(value)
    return value


def parse_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Typed, known options (None values dropped, as Ollama skips them); 400 names a bad one."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if value is None:
            continue
        if name not in _SAMPLING and name not in _INT_OPTIONS | _FLOAT_OPTIONS | _BOOL_OPTIONS:
            logger.info("ignoring unknown Ollama option %r", name)
            continue
        out[name] = _typed(name, value)
    if out.get("typical_p", 1.0) != 1.0:
        raise APIError.bad_request("options.typical_p: only 1.0 (off) is supported",
                                   "options.typical_p")
    for name in _IGNORED & out.keys():
        logger.info("ignoring Ollama option %r (no effect on this server)", name)
    return out


def sampling_fields(options: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI request fields for parsed ``options``, Ollama's defaults for the rest."""
    fields = {_SAMPLING[k]: v for k, v in _DEFAULTS.items()}
    for name, value in options.items():
        if name in _SAMPLING:
            fields[_SAMPLING[name]] = value
    if fields.get("seed") == -1:
        fields["seed"] = None  # Ollama's "random"
    if fields.get("top_k", 0) <= 0:
        fields["top_k"] = None  # Ollama's 0: no top-k
    return fields


def format_fields(fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """``format`` as the OpenAI request's structured output: "json", a schema, or none."""
    if fmt is None or fmt in ("", "null"):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"structured_outputs": {"json": fmt}}
    raise APIError.bad_request(
        f'format: invalid format: {fmt!r}; expected "json" or a valid JSON Schema', "format")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as the chat template takes them (OpenAI's shape); images refused."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.get("images"):
            raise APIError.bad_request(
                f"messages[{i}].images: this model does not support images (forerun serves "
                "text-only models)", "messages")
        msg = {k: v for k, v in m.items()
               if k not in ("images", "thinking", "tool_name", "tool_calls")}
        # Ollama's content defaults to "" (Go's zero value); its client leaves out empty ones.
        msg.setdefault("content", "")
        if m.get("tool_name") is not None:
            msg["name"] = m["tool_name"]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise APIError.bad_request(f"messages[{i}].tool_calls: must be an array",
                                           "messages")
            msg["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError.bad_request(
            f"messages[{i}].tool_calls[{j}].function.name: must be a string", "messages")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": fn["name"],
                                        "arguments": fn.get("arguments") or {}}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
