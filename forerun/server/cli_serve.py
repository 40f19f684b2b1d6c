"""``forerun serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from types import FrameType
from typing import Any

import uvicorn

from forerun.engine.async_llm import AsyncLLM
from forerun.engine.core_client import EngineDeadError, EngineStartupError
from forerun.engine_args import add_engine_args, config_from_args
from forerun.model.errors import ModelLoadError
from forerun.server.api import build_app
from forerun.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``serve`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model_tag", nargs="?", default=None,
                   help="model to serve (same as --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("FORERUN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model's name)")
    p.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   default=True, help="run the engine core in a thread of the API process")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGINT/SIGTERM end in-flight requests instead of waiting on them."""

    engine: AsyncLLM | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        engine = self.engine
        if engine is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon_threadsafe(
                engine.fail_all, EngineDeadError("the server is shutting down"))


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag and not args.model:
        args.model = args.model_tag
    try:
        config = config_from_args(args)
        engine = AsyncLLM(config, engine_process=args.engine_process)
    except (EngineStartupError, ModelLoadError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    model_name = args.served_model_name or engine.model_info.source.name
    try:
        metrics = ServerMetrics(model_name)
        engine.observer = metrics
        app = build_app(engine, model_name, args.api_key, metrics)
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level=args.log_level, timeout_graceful_shutdown=5,
                                        access_log=args.log_level == "debug"))
        server.engine = engine
        logger.info("serving %s on http://%s:%d", model_name, args.host, args.port)
        try:
            asyncio.run(server.serve())
        except KeyboardInterrupt:
            # uvicorn re-raises SIGINT after its graceful shutdown; that is a normal exit.
            pass
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
    return 0
