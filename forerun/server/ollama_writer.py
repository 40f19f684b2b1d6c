"""Ollama's replies from the engine's outputs: NDJSON chunks or one object, the closing
``done`` chunk with its counts and durations, tool calls in Ollama's shape, and (with a
reasoning parser) the thinking in ``thinking`` beside the content."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from forerun.engine.async_llm import RequestStream, RequestTimeoutError
from forerun.engine.core_client import EngineDeadError
from forerun.outputs import RequestOutput
from forerun.server.ollama_models import rfc3339
from forerun.server.ollama_protocol import OllamaError
from forerun.server.reasoning import ChoiceReasoningStream, ReasoningPlan
from forerun.server.tool_calls import ChoiceToolStream, ToolPlan, tool_message

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Timing:
    """Ollama's durations in nanoseconds: load is the request's preparation (forerun keeps
    its model loaded), prompt eval runs to the first token, eval from there to the last."""

    start: int
    queued: int = 0
    first: int = 0
    last: int = 0

    def saw(self, out: RequestOutput) -> None:
        now = time.perf_counter_ns()
        if not self.first and out.outputs and out.outputs[0].token_ids:
            self.first = now
        self.last = now

    def final(self, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        first = self.first or self.last
        return {"done": True, "done_reason": c.finish_reason or "stop",
                "total_duration": self.last - self.start,
                "load_duration": self.queued - self.start,
                "prompt_eval_count": len(out.prompt_token_ids),
                "prompt_eval_duration": first - self.queued,
                "eval_count": len(c.token_ids), "eval_duration": self.last - first}


class ResponseWriter:
    """The engine's outputs of one request as Ollama's chunks (chat or generate)."""

    def __init__(self, model: str, chat: bool, plan: ToolPlan, timing: Timing,
                 rplan: ReasoningPlan | None = None) -> None:
        self.model, self.chat, self.plan, self.timing = model, chat, plan, timing
        self.rplan = rplan
        # Forced calls are JSON, not text: shown only as tool_calls once whole.
        self.quiet = plan.mode in ("required", "named")
        self.tools = ChoiceToolStream(plan) if plan.mode == "auto" else None
        self.thinking = ChoiceReasoningStream(rplan) if rplan is not None else None
        self.sent = 0  # characters of the text already streamed

    def chunk(self, text: str, thinking: str | None = None, **extra: Any) -> dict[str, Any]:
        """One reply object; ``thinking`` only when there is some (Ollama omits it)."""
        out: dict[str, Any] = {"model": self.model, "created_at": rfc3339()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking:
                out["message"]["thinking"] = thinking
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        out.update(extra)
        return out

    def split(self, text: str) -> tuple[str | None, str]:
        """(thinking, answer) of a whole output: the thinking None when there is none or
        the request turned it off (``think: false``)."""
        if self.rplan is None:
            return None, text
        reasoning, content = self.rplan.split_whole(text)
        return (reasoning if self.rplan.include else None), content

    def pieces(self, text: str, finished: bool) -> tuple[str, str]:
        """What the text so far adds to the reply's (thinking, visible content)."""
        thought, answer, piece = "", text, text[self.sent:]
        if self.thinking is not None:  # the split first: tools read the answer only
            d = self.thinking.step(text, finished)
            thought, answer, piece = d.reasoning or "", d.content_so_far, d.content or ""
        if self.quiet:
            return thought, ""
        if self.tools is not None:
            # harmony's parser reads the whole text and skips the thinking itself
            d = self.tools.delta(text if self.plan.reads_whole_output else answer, finished)
            return thought, d.content if d is not None and isinstance(d.content, str) else ""
        return thought, piece

    def end(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The closing chunks: the tool calls (whole), then ``done`` with the counts."""
        c = out.outputs[0]
        if c.finish_reason not in ("stop", "length"):
            raise OllamaError(500, f"the engine ended this request with {c.finish_reason!r} "
                                   "(the server log says why, e.g. a grammar that did not "
                                   "compile in time)")
        closing: list[dict[str, Any]] = []
        if self.plan.mode != "none":
            answer = self.split(c.text)[1]
            message, _ = tool_message(self.plan, "assistant",
                                      c.text if self.plan.reads_whole_output else answer,
                                      c.finish_reason)
            calls = _ollama_calls(message.tool_calls)
            if calls:
                closing.append(self.chunk(""))
                closing[-1]["message"]["tool_calls"] = calls
            elif self.quiet and answer:
                closing.append(self.chunk(answer))  # cut short: what was written
        done = self.chunk("", **self.timing.final(out))
        if not self.chat:
            done["context"] = [*out.prompt_token_ids, *c.token_ids]
        return [*closing, done]

    async def lines(self, stream: RequestStream) -> AsyncIterator[bytes]:
        try:
            last = None
            async for out in stream:
                self.timing.saw(out)
                last = out
                c = out.outputs[0]
                thought, piece = self.pieces(c.text, c.finish_reason is not None)
                self.sent = len(c.text)
                if piece or thought:
                    yield _line(self.chunk(piece, thought))
            assert last is not None
            for chunk in self.end(last):
                yield _line(chunk)
        except (EngineDeadError, RequestTimeoutError) as exc:
            yield _line({"error": str(exc)})
        except OllamaError as exc:
            yield _line({"error": exc.message})
        finally:
            stream.abort()

    async def whole(self, stream: RequestStream) -> dict[str, Any]:
        try:
            last = None
            async for out in stream:
                self.timing.saw(out)
                last = out
        finally:
            stream.abort()
        assert last is not None
        *closing, done = self.end(last)
        c = last.outputs[0]
        thought, answer = self.split(c.text)
        if not self.chat:
            done["response"] = answer
            if thought:
                done["thinking"] = thought
            return done
        calls = [t for ch in closing for t in ch["message"].get("tool_calls", [])]
        if self.quiet:  # forced calls: text only when cut short before a whole call
            content = "".join(ch["message"]["content"] for ch in closing)
        elif self.plan.mode == "auto":
            content = tool_message(self.plan, "assistant",
                                   c.text if self.plan.reads_whole_output else answer,
                                   c.finish_reason)[0].content
        else:
            content = answer
        done["message"] = {"role": "assistant", "content": content or ""}
        if thought:
            done["message"]["thinking"] = thought
        if calls:
            done["message"]["tool_calls"] = calls
        return done


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _ollama_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """OpenAI tool calls (arguments as JSON text) in Ollama's shape (arguments an object)."""
    out: list[dict[str, Any]] = []
    for i, tc in enumerate(calls):
        try:
            args = json.loads(tc.function.arguments or "{}")
        except ValueError:
            logger.info("dropping tool call %r: its arguments are not JSON", tc.function.name)
            continue
        out.append({"id": tc.id, "function": {"index": i, "name": tc.function.name,
                                              "arguments": args}})
    return out
