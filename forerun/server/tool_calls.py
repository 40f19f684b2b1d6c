"""``tools`` and ``tool_choice`` on /v1/chat/completions, with vLLM's semantics.

- ``none`` (the default without tools): the tools are still rendered by the chat template,
  the output is plain content.
- ``auto`` (the default with tools): needs ``--enable-auto-tool-choice`` and
  ``--tool-call-parser``; the parser finds calls in the model's free text.
- ``required``: structured output forces a JSON array of ``{"name", "parameters"}`` objects,
  one per call, each ``parameters`` valid against its function's schema.
- a named function: structured output forces that function's arguments.

Forced calls are valid with any model; finish_reason is ``tool_calls`` for ``auto`` and
``required`` calls and ``stop`` for a named one (OpenAI's and vLLM's rule), and an output
cut by ``max_tokens`` keeps ``length``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from forerun.server.bodies import (
    UNSET,
    ChatDelta,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from forerun.server.errors import APIError
from forerun.tool_parsers import (
    FunctionCallDraft,
    ParsedToolOutput,
    ToolParser,
    ToolParserManager,
)
from forerun.tool_parsers.json_scan import object_members, skip_ws

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCallConfig:
    """The server's tool flags: ``--enable-auto-tool-choice``, ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            ToolParserManager.get_tool_parser(self.tool_call_parser)  # KeyError if unknown
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


def _function_of(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError.bad_request(f"{where}.type: only 'function' tools are supported",
                                   "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError.bad_request(f"{where}.function.name: must be a non-empty string",
                                   "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise APIError.bad_request(f"{where}.function.parameters: must be a JSON schema "
                                   "object", "tools")
    return fn


class _NamedCallParser(ToolParser):
    """The output is the arguments of one function, forced by structured output."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, finished: bool) -> ParsedToolOutput:
        return ParsedToolOutput("", [FunctionCallDraft(self.name, text)])


class _RequiredCallsParser(ToolParser):
    """The output is ``[{"name": ..., "parameters": {...}}, ...]``, forced by structured
    output; each call's arguments are its ``parameters`` as the model wrote them."""

    def parse(self, text: str, finished: bool) -> ParsedToolOutput:
        if finished:
            try:
                json.loads(text)
            except ValueError:
                return ParsedToolOutput(text)  # cut short: no calls to offer
        calls: list[FunctionCallDraft] = []
        j = skip_ws(text, 0)
        if j >= len(text) or text[j] != "[":
            return ParsedToolOutput("")
        j = skip_ws(text, j + 1)
        while j < len(text) and text[j] == "{":
            members, end = object_members(text, j)
            by_key = {m.key: m for m in members}
            name_m, params_m = by_key.get("name"), by_key.get("parameters")
            if name_m is None or name_m.value_end is None:
                break
            name = json.loads(text[name_m.value_start:name_m.value_end])
            args = "" if params_m is None else text[
                params_m.value_start:len(text) if params_m.value_end is None
                else params_m.value_end]
            calls.append(FunctionCallDraft(name, args))
            if end is None:
                break
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ",":
                j = skip_ws(text, j + 1)
        return ParsedToolOutput("", calls)


def _required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [{
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": fn.get("parameters") or _EMPTY_PARAMETERS},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        } for fn in functions]},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(slots=True)
class ToolPlan:
    """How one request treats tools: what the template sees, what the output is forced
    to, and how the output is read back."""

    tools: list[dict[str, Any]] | None
    mode: str  # "none", "auto", "required" or "named"
    schema: dict[str, Any] | None = None
    parser_cls: type[ToolParser] | None = None
    function_name: str | None = None
    parallel: bool = True
    tokenizer: Any = None  # handed to the parser, which may look at its special tokens

    def new_parser(self) -> ToolParser | None:
        if self.mode == "named":
            assert self.function_name is not None
            return _NamedCallParser(self.function_name)
        if self.mode == "required":
            return _RequiredCallsParser()
        if self.mode == "auto":
            assert self.parser_cls is not None
            return self.parser_cls(self.tokenizer)
        return None

    @property
    def reads_whole_output(self) -> bool:
        """Whether the parser takes the model's whole text, not the reasoning parser's
        content (harmony: the calls are named in the headers that content drops)."""
        return self.mode == "auto" and self.parser_cls is not None \
            and self.parser_cls.reads_whole_output

    def adjust_request(self, body: Any) -> Any:
        """The body to run: forced calls as a structured output, the parser's tweaks."""
        if self.schema is not None:
            return body.model_copy(update={"structured_outputs": {"json": self.schema}})
        parser = self.new_parser()
        return body if parser is None else parser.adjust_request(body)

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        if called and engine_reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar")


def plan_tools(config: ToolCallConfig, body: Any, tokenizer: Any = None) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; 400s name the field."""
    tools, choice = body.tools, body.tool_choice
    functions = [_function_of(i, t) for i, t in enumerate(tools or [])]
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return ToolPlan(tools or None, "none")
    if not functions:
        raise APIError.bad_request("tool_choice: needs tools; with no tools only 'none' "
                                   "is allowed", "tool_choice")
    if choice == "auto":
        if not (config.enable_auto_tool_choice and config.tool_call_parser):
            raise APIError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set", "tool_choice")
        return ToolPlan(tools, "auto", parser_cls=ToolParserManager.get_tool_parser(
            config.tool_call_parser), parallel=parallel, tokenizer=tokenizer)
    forced = [f for f in _STRUCTURED_FIELDS if getattr(body, f, None) is not None]
    if forced:
        raise APIError.bad_request(
            f"tool_choice: a required or named tool choice is enforced by structured "
            f"output; it cannot be combined with {forced[0]}", "tool_choice")
    if choice == "required":
        return ToolPlan(tools, "required", _required_schema(functions, parallel),
                        parallel=parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError.bad_request(
                'tool_choice: must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}', "tool_choice")
        match = [f for f in functions if f["name"] == name]
        if not match:
            raise APIError.bad_request(
                f"tool_choice: tool {name!r} has not been passed in `tools`", "tool_choice")
        return ToolPlan(tools, "named", match[0].get("parameters") or _EMPTY_PARAMETERS,
                        function_name=name)
    raise APIError.bad_request(
        f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}',
        "tool_choice")


def tool_message(plan: ToolPlan, role: str, text: str, engine_reason: str | None,
                 ) -> tuple[ChatMessage, str | None]:
    """The whole response's message for one choice, and its finish_reason."""
    parser = plan.new_parser()
    if parser is None:
        return ChatMessage(role, text), engine_reason
    info = parser.extract_tool_calls(text)
    calls = info.tool_calls if plan.parallel else info.tool_calls[:1]
    message = ChatMessage(role, info.content, tool_calls=[
        ToolCall(random_tool_call_id(), FunctionCall(c.name, c.arguments)) for c in calls])
    return message, plan.finish_reason(engine_reason, info.tools_called)


class ChoiceToolStream:
    """Turns one streamed choice's text into content and ``delta.tool_calls``."""

    def __init__(self, plan: ToolPlan) -> None:
        parser = plan.new_parser()
        assert parser is not None
        self.plan, self.parser = plan, parser
        self.text = ""
        self.called = False

    def delta(self, current_text: str, finished: bool) -> ChatDelta | None:
        """What ``current_text`` (the choice's whole text so far) adds; None if nothing."""
        d = self.parser.extract_tool_calls_streaming(
            self.text, current_text, current_text[len(self.text):], finished=finished)
        self.text = current_text
        if d is None:
            return None
        calls = [c for c in d.tool_calls if self.plan.parallel or c.index == 0]
        self.called = self.called or bool(calls)
        wire = [DeltaToolCall(c.index, random_tool_call_id(), "function",
                              DeltaFunctionCall(c.name, c.arguments)) if c.name is not None
                else DeltaToolCall(c.index, function=DeltaFunctionCall(arguments=c.arguments))
                for c in calls]
        if d.content is None and not wire:
            return None
        return ChatDelta(content=UNSET if d.content is None else d.content,
                         tool_calls=wire or UNSET)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.plan.finish_reason(engine_reason, self.called)

