"""How the HTTP server guards itself: the ``forerun serve`` flags that are not the engine's."""

from __future__ import annotations

from dataclasses import dataclass

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
    # vLLM's --enable-force-include-usage: streams end with a usage chunk even when the
    # request did not ask for one with stream_options.include_usage.
    enable_force_include_usage: bool = False

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
