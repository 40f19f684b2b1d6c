"""``forerun serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
from types import FrameType
from typing import Any

import uvicorn

from forerun import envs
from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM
from forerun.engine.core_client import EngineDeadError, EngineStartupError
from forerun.engine_args import add_engine_args, config_from_args
from forerun.model.errors import ModelLoadError
from forerun.server.api import build_app
from forerun.server.config import ServerConfig, parse_structured_outputs_config
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
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                        f"${envs.API_KEY}, which unlike a flag does not show in ps)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients may send as 'model'; the first is the one responses "
                        "report (default: the model's name)")
    p.add_argument("--uds", default=None,
                   help="serve on this unix domain socket; --host and --port are ignored")
    p.add_argument("--root-path", default="",
                   help="path prefix a reverse proxy strips (FastAPI's root_path)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="echo X-Request-Id on responses (a new one when the request has "
                        "none)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count requests in flight on the generation routes, for GET /load")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (publishes the tokenizer's config)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no INFO line per request (they are logged by default)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one INFO line per request (the default; for vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools on its own (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", default=None,
                   help="how tool calls are read from the model's text: hermes "
                        "(<tool_call>{...}</tool_call>, Qwen2/3, Hermes) or openai "
                        "(harmony's messages to=functions.NAME, gpt-oss)")
    p.add_argument("--reasoning-parser", default=None,
                   help="split the model's thinking into reasoning_content: "
                        "deepseek_r1, qwen3 (<think>...</think>) or openai_gptoss (harmony)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) used "
                        "instead of the model's own")
    p.add_argument("--structured-outputs-config", default=None,
                   help='vLLM\'s JSON object; forerun reads "disable_any_whitespace" (the '
                        "server-wide whitespace mode of JSON constraints; false allows any "
                        "whitespace, true only one space after ',' and ':' -- unset, forerun's "
                        'compact default), "enable_in_reasoning" (true: with '
                        "--reasoning-parser, constrain the reasoning too; by default the "
                        'grammar starts after it) and "backend" (auto or xgrammar)')
    p.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                   default=True, help="run the engine core in a thread of the API process")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    d = ServerConfig()
    g = p.add_argument_group("limits")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="bigger bodies get 413 (default: %(default)s)")
    g.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="sequences that may wait beyond --max-num-seqs; more get 503 with "
                        "Retry-After (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="abort a request running longer than this many seconds (504)")
    g.add_argument("--engine-heartbeat-timeout", type=float,
                   default=d.engine_heartbeat_timeout_s,
                   help="seconds without a beat from the engine core before /health "
                        "reports 503 (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="on SIGTERM, seconds in-flight requests may take to finish "
                        "(default: %(default)s)")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with a usage chunk, as if the request had set "
                        "stream_options.include_usage")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="show logprobs' tokens as 'token_id:<id>' unless a request sets "
                        "return_tokens_as_token_ids itself")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json")
    g.add_argument("--disable-web-page", action="store_true",
                   help="serve no web page (chat and live engine view) at /")
    add_engine_args(p)
    p.set_defaults(func=run_serve)
    return p


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The HTTP layer's settings from ``serve`` flags; ValueError if invalid."""
    return ServerConfig(
        api_key=args.api_key if args.api_key is not None else envs.api_key(),
        max_request_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        disable_fastapi_docs=args.disable_fastapi_docs,
        disable_web_page=args.disable_web_page,
        enable_force_include_usage=args.enable_force_include_usage,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        served_model_names=tuple(args.served_model_name or ()),
        root_path=args.root_path,
        uds=args.uds,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_server_load_tracking=args.enable_server_load_tracking,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        log_requests=not args.disable_log_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template=_read_template(args.chat_template),
        structured_outputs_disable_any_whitespace=_structured_config(
            args.structured_outputs_config).get("disable_any_whitespace"),
        structured_outputs_enable_in_reasoning=_structured_config(
            args.structured_outputs_config).get("enable_in_reasoning", False),
    )


def _structured_config(text: str | None) -> dict[str, Any]:
    return {} if text is None else parse_structured_outputs_config(text)


def _read_template(value: str | None) -> str | None:
    """--chat-template is a path or the template itself, as in vLLM."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


class _Server(uvicorn.Server):
    """uvicorn, plus forerun's shutdown rules.

    SIGTERM drains: new requests are refused, in-flight ones run to the end for up to
    ``--shutdown-timeout`` (uvicorn's graceful shutdown), then the rest are cancelled.
    SIGINT (Ctrl-C) is "stop now": in-flight requests end at once with an error.
    A dead engine core also stops the server, which then exits non-zero.
    """

    engine: AsyncLLM | None = None
    engine_died: bool = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        engine = self.engine
        if engine is None:
            return
        engine.stop_accepting("the server is shutting down")
        if sig == signal.SIGTERM:
            logger.info("SIGTERM: draining in-flight requests (up to %.0f s)",
                        self.config.timeout_graceful_shutdown or 0)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(
            engine.fail_all, EngineDeadError("the server is shutting down"))

    def on_engine_dead(self, message: str) -> None:
        logger.error("the engine core is dead (%s); the server exits", message)
        self.engine_died = True
        self.should_exit = True


def cache_info(config: EngineConfig) -> dict[str, str]:
    """The KV cache's settings, as vLLM's ``cache_config_info`` labels (strings)."""
    return {"block_size": str(config.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
            "num_cpu_blocks": "None"}


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag and not args.model:
        args.model = args.model_tag
    try:
        server_config = server_config_from_args(args)
        config = config_from_args(args)
        if config.node_rank > 0:
            # A worker node: its ranks only; node 0 serves the API (so the API process
            # imports the worker code only here).
            from forerun.engine.worker_node import run_worker_node

            return run_worker_node(config)
        engine = AsyncLLM(config, engine_process=args.engine_process,
                          max_waiting_requests=server_config.max_waiting_requests,
                          request_timeout_s=server_config.request_timeout_s,
                          heartbeat_timeout_s=server_config.engine_heartbeat_timeout_s)
    except (EngineStartupError, ModelLoadError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    names = server_config.served_model_names or (engine.model_info.source.name,)
    model_name = names[0]
    try:
        metrics = ServerMetrics(model_name, engine.max_model_len,
                                config.max_num_batched_tokens, cache_info(config))
        engine.observer = metrics
        app = build_app(engine, model_name, server_config, metrics)
        server = _Server(uvicorn.Config(
            app, host=args.host, port=args.port, uds=server_config.uds,
            log_level=args.log_level,
            timeout_graceful_shutdown=int(math.ceil(server_config.shutdown_timeout_s)),
            access_log=args.log_level == "debug"))
        server.engine = engine
        engine.on_dead = server.on_engine_dead
        where = (f"unix:{server_config.uds}" if server_config.uds
                 else f"http://{args.host}:{args.port}")
        logger.info("serving %s on %s%s", ", ".join(names), where, server_config.root_path)
        try:
            asyncio.run(server.serve())
        except KeyboardInterrupt:
            # uvicorn re-raises SIGINT after its graceful shutdown; that is a normal exit.
            pass
    finally:
        engine.shutdown()  # no-op when the lifespan already stopped it
    return 1 if server.engine_died else 0
