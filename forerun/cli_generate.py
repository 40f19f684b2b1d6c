"""``forerun generate`` and ``forerun chat``: the offline engine from a terminal."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from forerun.engine.chat import apply_chat_template
from forerun.engine.llm_engine import LLMEngine
from forerun.engine.worker_node import run_worker_node
from forerun.engine_args import add_engine_args, config_from_args
from forerun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed if args.temperature > 0 else None, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def add_generate_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="complete a prompt, streaming the text")
    p.add_argument("prompt", help="the text to continue ('-' reads standard input)")
    _add_sampling_args(p, max_tokens=64)
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def add_chat_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="an interactive chat with the model's template")
    p.add_argument("--system", default=None, help="a system message")
    _add_sampling_args(p, max_tokens=256)
    add_engine_args(p)
    p.set_defaults(func=run_chat)


def _stream(engine: LLMEngine, request_id: str, prompt: Any, params: SamplingParams) -> str:
    """Run one request to completion, writing text to stdout as it arrives."""
    engine.add_request(request_id, prompt, params)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return text


def _start(args: argparse.Namespace) -> tuple[SamplingParams, LLMEngine] | None:
    """Validate the flags and load the engine; None (after saying why) if that fails."""
    try:
        config = config_from_args(args)
        if config.node_rank > 0:
            # A worker node of a multi-node (or torchrun) group: ranks only, no output.
            raise SystemExit(run_worker_node(config))
        return _params(args), LLMEngine(config)
    except ValueError as e:  # ModelLoadError is a ValueError too
        print(f"error: {e}", file=sys.stderr)
        return None


def run_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    started = _start(args)
    if started is None:
        return 2
    params, engine = started
    try:
        _stream(engine, "generate-0", prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    started = _start(args)
    if started is None:
        return 2
    params, engine = started
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("forerun chat — an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    turn = 0
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            ids = apply_chat_template(engine.tokenizer, messages)
            reply = _stream(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params)
            messages.append({"role": "assistant", "content": reply})
            turn += 1
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0
