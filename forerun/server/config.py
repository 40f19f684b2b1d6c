"""How the HTTP server guards itself: the ``forerun serve`` flags that are not the engine's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from forerun.reasoning import ReasoningParserManager
from forerun.tool_parsers import ToolParserManager

# A body at least this big is parsed, validated and tokenised on a worker thread, so one
# huge request cannot stall every other HTTP call (``/health`` included) on the event loop.
OFFLOAD_BODY_BYTES = 64 << 10


@dataclass(slots=True)
class ServerConfig:
    """Limits and switches of the HTTP layer (the engine's are in ``EngineConfig``)."""

    api_key: str | None = None
    # Bodies above this get 413 before they are read whole.
    max_request_body_bytes: int = 32 << 20
    # Sequences allowed to wait beyond --max-num-seqs; more get 503 with Retry-After.
    max_waiting_requests: int = 4096
    # None: no limit. A request running longer is aborted and answered 504.
    request_timeout_s: float | None = None
    # /health turns 503, and new requests are refused, after this long without a beat.
    engine_heartbeat_timeout_s: float = 30.0
    # SIGTERM: stop admitting, let in-flight requests finish for up to this long, exit.
    shutdown_timeout_s: float = 30.0
    disable_fastapi_docs: bool = False
    # No web page (chat and live engine view) at / and /forerun/static/ (forerun/server/web.py).
    disable_web_page: bool = False
    # vLLM's --enable-force-include-usage: streams end with a usage chunk even when the
    # request did not ask for one with stream_options.include_usage.
    enable_force_include_usage: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens as ``token_id:<id>`` for
    # requests that do not set return_tokens_as_token_ids themselves.
    return_tokens_as_token_ids: bool = False
    # Every name clients may send as ``model``; the first is the one responses report.
    served_model_names: tuple[str, ...] = ()
    # The path prefix a reverse proxy strips before forwarding (FastAPI's root_path).
    root_path: str = ""
    # Serve on this unix domain socket instead of host:port.
    uds: str | None = None
    # Echo X-Request-Id on every response (a fresh one when the request has none).
    enable_request_id_headers: bool = False
    # Count requests in flight on the generation routes, for GET /load.
    enable_server_load_tracking: bool = False
    # Serve GET /tokenizer_info (it publishes the tokenizer's configuration).
    enable_tokenizer_info_endpoint: bool = False
    # One INFO line per admitted request.
    log_requests: bool = True
    # Tool calling: tool_choice "auto" needs both (forerun/server/tool_calls.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser: split the model's thinking from its answer on chat responses
    # (forerun/server/reasoning.py); None: the output is all content, as before.
    reasoning_parser: str | None = None
    # A Jinja chat template replacing the model's own (--chat-template).
    chat_template: str | None = None
    # --structured-outputs-config '{"disable_any_whitespace": ...}': the whitespace mode of
    # JSON constraints for requests that do not choose one (None: forerun's compact one).
    structured_outputs_disable_any_whitespace: bool | None = None
    # '{"enable_in_reasoning": true}': with --reasoning-parser, structured output constrains
    # the reasoning too (False, vLLM's default: it starts once the reasoning ends).
    structured_outputs_enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be at least 1024")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be non-negative")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if self.engine_heartbeat_timeout_s <= 0:
            raise ValueError("engine_heartbeat_timeout_s must be positive")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be non-negative")
        if self.tool_call_parser is not None \
                and self.tool_call_parser not in ToolParserManager.tool_parsers:
            raise ValueError(f"tool_call_parser: {self.tool_call_parser!r} is not one of "
                             f"{sorted(ToolParserManager.tool_parsers)}")
        if self.reasoning_parser is not None \
                and self.reasoning_parser not in ReasoningParserManager.reasoning_parsers:
            raise ValueError(f"reasoning_parser: {self.reasoning_parser!r} is not one of "
                             f"{sorted(ReasoningParserManager.reasoning_parsers)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if any(not name for name in self.served_model_names):
            raise ValueError("served_model_names: a name must not be empty")
        if self.root_path and (not self.root_path.startswith("/")
                               or self.root_path.endswith("/")):
            raise ValueError("root_path must start with '/' and not end with one, got "
                             f"{self.root_path!r}")


# vLLM's StructuredOutputsConfig keys that forerun reads; a backend other than xgrammar
# (forerun's only one) is refused rather than ignored.
_STRUCTURED_CONFIG_KEYS = ("backend", "disable_any_whitespace", "enable_in_reasoning")


def parse_structured_outputs_config(text: str) -> dict[str, Any]:
    """``--structured-outputs-config``: vLLM's JSON object; ValueError says what is wrong."""
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--structured-outputs-config: not JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError("--structured-outputs-config: must be a JSON object")
    unknown = sorted(set(value) - set(_STRUCTURED_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--structured-outputs-config: unsupported key(s) {unknown}; "
                         f"forerun reads {list(_STRUCTURED_CONFIG_KEYS)}")
    if value.get("backend", "auto") not in ("auto", "xgrammar"):
        raise ValueError("--structured-outputs-config: backend must be 'auto' or 'xgrammar' "
                         f"(forerun's), got {value['backend']!r}")
    for key in ("disable_any_whitespace", "enable_in_reasoning"):
        if not isinstance(value.get(key, False), bool):
            raise ValueError(f"--structured-outputs-config: {key} must be a boolean")
    return value

