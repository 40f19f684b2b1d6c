"""The web page at ``/``: a chat with the served model and a live view of the engine.

The page is three static files shipped in the package (``forerun/server/static/``: plain
HTML, JS and CSS, nothing fetched from elsewhere, nothing built at install time). It chats
through ``/v1/chat/completions`` like any client, and polls ``GET /forerun/engine``, which
this module also serves: the engine's queues, KV cache use, token counters and the step
spans of the last :data:`SPAN_WINDOW_S` seconds, for the page's timeline of schedule /
update on the engine thread against forward / sample on the worker.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from forerun.core.stats import EngineStats
from forerun.engine.async_llm import AsyncLLM
from forerun.server.metrics import ENGINE_INDEX, ServerMetrics
from forerun.trace import ENGINE_LANE, WORKER_LANE

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
# How far back the page's timeline reaches.
SPAN_WINDOW_S = 2.0
# A bound on the spans one reply carries (a fast device runs thousands of steps a second).
MAX_SPANS = 3000


def register_web_page(app: FastAPI, engine: AsyncLLM, metrics: ServerMetrics,
                      model_name: str, enabled: bool = True) -> None:
    """Serve the page at ``/`` and its files under ``/forerun/static/`` when ``enabled``
    (``--disable-web-page`` turns it off: ``/`` is then a 404), and ``/forerun/engine``
    always (a JSON view of the engine, as cheap as a ``/metrics`` scrape)."""

    @app.get("/forerun/engine")
    async def engine_view() -> Response:
        try:
            stats = await engine.get_engine_stats(timeout_s=5.0, span_window_s=SPAN_WINDOW_S)
        except (TimeoutError, RuntimeError) as exc:
            # The page shows the engine as unreachable rather than the request failing.
            logger.warning("could not read engine stats for the web page: %s", exc)
            return JSONResponse({"error": str(exc)}, status_code=503)
        return JSONResponse(engine_view_body(stats, metrics, model_name))

    if not enabled:
        return
    app.mount("/forerun/static", StaticFiles(directory=STATIC_DIR), name="forerun-static")

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def engine_view_body(stats: list[EngineStats], metrics: ServerMetrics,
                     model_name: str) -> dict[str, Any]:
    """The ``/forerun/engine`` JSON: queues and KV use summed over data-parallel engines,
    token totals since start (the page turns them into rates), and the recent spans as
    ``[name, lane, start_s, end_s, step]`` with times in seconds before now (rank 0's when
    there are several engines: one timeline is what the page draws)."""
    labels = {"model_name": metrics.model_name, "engine": ENGINE_INDEX}

    def total(name: str) -> float:
        return metrics.inner.get_sample_value(name, labels) or 0.0

    blocks = sum(s.kv_cache.num_blocks for s in stats)
    used = sum(s.kv_cache.usage * s.kv_cache.num_blocks for s in stats)
    spans = stats[0].recent_spans[-MAX_SPANS:] if stats else []
    return {
        "model": model_name,
        "async_scheduling": bool(stats) and stats[0].async_scheduling,
        "num_engines": len(stats),
        "num_requests_running": sum(s.scheduler.num_running_reqs for s in stats),
        "num_requests_waiting": sum(s.scheduler.num_waiting_reqs for s in stats),
        "kv_cache_usage": used / blocks if blocks else 0.0,
        "num_preemptions": sum(s.scheduler.num_preemptions for s in stats),
        "prompt_tokens_total": total("prompt_tokens_total"),
        "generation_tokens_total": total("generation_tokens_total"),
        "window_s": SPAN_WINDOW_S,
        "lanes": {"engine": ENGINE_LANE, "worker": WORKER_LANE},
        "spans": [[s.name, s.lane, s.start, s.end, s.step] for s in spans],
    }
