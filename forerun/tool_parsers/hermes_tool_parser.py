"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2 Pro and later, Qwen2/2.5/3 and the templates derived from them.
Content before the first tag is the message's content; each tag is one call, its
``arguments`` passed on as the model wrote them. If any tag does not hold a JSON object with
a string ``name``, the whole text is content and there are no calls (as in vLLM).
"""

from __future__ import annotations

import json
from typing import Any

from forerun.tool_parsers.abstract_tool_parser import (
    FunctionCallDraft,
    ParsedToolOutput,
    ToolParser,
)
from forerun.tool_parsers.json_scan import object_members, skip_ws

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Hermes2ProToolParser(ToolParser):
    """``--tool-call-parser hermes``."""

    def adjust_request(self, request: Any) -> Any:
        # Where <tool_call> is a special token, skipping special tokens would erase the
        # very tags this parser looks for. Only there: keeping them would also keep the
        # end-of-turn token's text in the content.
        special = getattr(self.model_tokenizer, "all_special_tokens", None) or ()
        if TOOL_CALL_START in special and getattr(request, "skip_special_tokens", False):
            return request.model_copy(update={"skip_special_tokens": False})
        return request

    def parse(self, text: str, finished: bool) -> ParsedToolOutput:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            hold = 0 if finished else _held_back(text, TOOL_CALL_START)
            return ParsedToolOutput(text[:len(text) - hold])
        calls: list[FunctionCallDraft] = []
        pos = start
        while pos >= 0:
            i = skip_ws(text, pos + len(TOOL_CALL_START))
            if i >= len(text) and not finished:
                break
            if i >= len(text) or text[i] != "{":
                return self._not_calls(text, finished, start, calls)
            members, end = object_members(text, i)
            if finished and not self._is_call(text, i, end):
                return ParsedToolOutput(text)
            by_key = {m.key: m for m in members}
            name_m, args_m = by_key.get("name"), by_key.get("arguments")
            if name_m is None or name_m.value_end is None:
                break
            name = json.loads(text[name_m.value_start:name_m.value_end])
            if args_m is not None:
                arguments = text[args_m.value_start:
                                 len(text) if args_m.value_end is None else args_m.value_end]
            else:
                arguments = "{}" if end is not None else ""
            calls.append(FunctionCallDraft(name, arguments))
            if end is None:
                break
            pos = text.find(TOOL_CALL_START, end)
        return ParsedToolOutput(text[:start], calls)

    @staticmethod
    def _is_call(text: str, i: int, end: int | None) -> bool:
        if end is None:
            return False
        try:
            obj = json.loads(text[i:end])
        except ValueError:
            return False
        return isinstance(obj, dict) and isinstance(obj.get("name"), str)

    @staticmethod
    def _not_calls(text: str, finished: bool, start: int,
                   calls: list[FunctionCallDraft]) -> ParsedToolOutput:
        # A tag not followed by an object: all content once finished; while streaming,
        # keep what was shown so far and wait.
        if finished:
            return ParsedToolOutput(text)
        return ParsedToolOutput(text[:start], calls)
