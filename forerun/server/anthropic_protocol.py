"""``POST /v1/messages`` bodies (Anthropic's Messages API) and their mapping onto chat.

A Messages request runs as the chat completion it amounts to: ``system`` becomes the
system message, content blocks become chat messages (``tool_use`` an assistant's
``tool_calls``, ``tool_result`` a ``tool`` message), ``stop_sequences`` is ``stop``,
``output_config.format`` is ``response_format`` and ``tool_choice`` any / tool are chat's
``required`` / named choice. Errors name the Anthropic field, with Anthropic's dotted paths
(``messages.1.content.0.type``).

``thinking`` needs ``--reasoning-parser`` (the body is parsed with the validation context
``{"reasoning": True}``); without it only ``{"type": "disabled"}`` is accepted, as before.
With it ``enabled`` (its ``budget_tokens`` checked as Anthropic checks it, not enforced) and
absent return the thinking, ``disabled`` drops it, and thinking blocks an assistant turn
replays are dropped (chat templates drop an earlier turn's thinking too).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from forerun.server.protocol import (
    ChatCompletionRequest,
    TextCheckedRequest,
    check_extra_fields,
)

logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# Fields forerun does not implement, with the values that mean "as if absent"; anything
# else is a 400 naming the field (the reason in _WHY). Unknown fields are ignored with a
# log line, as the OpenAI routes do.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),  # without --reasoning-parser
    "container": (None,),
    "mcp_servers": (None, []),
    "context_management": (None,),
    "inference_geo": (None,),
    "speed": (None, "standard"),
}
_WHY = {
    "thinking": "extended thinking is not supported by this server (the model has no "
                "separate reasoning output); leave it out or send {\"type\": \"disabled\"}",
    "container": "there is no code-execution container on this server",
    "mcp_servers": "this server does not connect to MCP servers",
    "context_management": "context management (clearing old tool results) is not supported",
    "inference_geo": "this server runs in one place; there is no region to choose",
    "speed": "only the standard speed exists on this server",
}
# Block types a client may send that are not text: a text-only model cannot read them.
_MEDIA = ("image", "document", "search_result")
# An earlier reply's thinking, replayed by a client (with --reasoning-parser): dropped.
_THINKING_BLOCKS = ("thinking", "redacted_thinking")
# Anthropic's least thinking budget.
MIN_THINKING_BUDGET = 1024


class ThinkingParam(BaseModel):
    """``thinking`` with --reasoning-parser: ``enabled`` (with ``budget_tokens``, which
    forerun checks but does not enforce) or ``disabled``."""

    model_config = _STRICT

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None

    @model_validator(mode="after")
    def _check_budget(self) -> ThinkingParam:
        if self.type == "enabled":
            if self.budget_tokens is None:
                raise ValueError("budget_tokens: Field required")
            if self.budget_tokens < MIN_THINKING_BUDGET:
                raise ValueError(f"budget_tokens: Input should be greater than or equal to "
                                 f"{MIN_THINKING_BUDGET}, got {self.budget_tokens}")
        return self


class TextBlockParam(BaseModel):
    """A text block of ``system``; ``cache_control`` and ``citations`` are accepted and
    ignored (forerun's prefix cache needs no breakpoints)."""

    model_config = _STRICT

    type: Literal["text"]
    text: str


class MessageParam(BaseModel):
    """One turn of ``messages``: its blocks are checked when mapped onto chat."""

    model_config = _STRICT

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolChoiceParam(BaseModel):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with ``name``) or ``none``."""

    model_config = _STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JSONOutputFormat(BaseModel):
    """``output_config.format``: the reply is JSON valid against ``schema``."""

    model_config = _STRICT

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``; ``effort`` (a reasoning budget) is refused when set."""

    model_config = _STRICT

    format: JSONOutputFormat | None = None
    effort: str | None = None


class _AnthropicBody(TextCheckedRequest):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the conversation."""

    model_config = _STRICT

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceParam | None = None
    output_config: OutputConfig | None = None
    thinking: Any = None  # checked below: what it may be depends on the server
    _thinking: ThinkingParam | None = PrivateAttr(None)
    _reasoning: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _reject_unsupported(self, info: ValidationInfo) -> _AnthropicBody:
        self._reasoning = bool((info.context or {}).get("reasoning"))
        extra = dict(self.model_extra or {})
        if self.thinking is not None and not self._reasoning:
            extra = {"thinking": self.thinking, **extra}
        check_extra_fields(extra, _UNSUPPORTED, _WHY)
        if self.thinking is not None and self._reasoning:
            try:
                self._thinking = ThinkingParam.model_validate(self.thinking)
            except ValidationError as exc:
                msg = validation_message(exc)
                pathed = exc.errors()[0].get("loc") or msg.startswith("budget_tokens")
                raise ValueError(f"thinking{'.' if pathed else ': '}{msg}") from None
        if self.output_config is not None and self.output_config.effort is not None:
            raise ValueError("output_config.effort: is not supported by this server (the "
                             "model has no reasoning budget to set)")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """``system`` then ``messages`` as chat messages; ValueError names the block."""
        out: list[dict[str, Any]] = []
        if isinstance(self.system, str):
            out.append({"role": "system", "content": self.system})
        elif self.system:
            out.append({"role": "system", "content": "".join(b.text for b in self.system)})
        if not self.messages:
            raise ValueError("messages: must hold at least one message")
        for i, m in enumerate(self.messages):
            out += _chat_turn(f"messages.{i}", m, self._reasoning)
        return out

    def thinking_switch(self) -> bool | None:
        """The request's ``thinking`` as a switch: None when absent, else whether on."""
        return None if self._thinking is None else self._thinking.type == "enabled"

    def template_fields(self) -> dict[str, Any]:
        """A last assistant turn is a prefill: the reply continues it (Anthropic's rule),
        so it is rendered open, without a new generation prompt."""
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant" or (not isinstance(last.content, str)
                                                        and any(b.get("type") == "tool_use"
                                                                for b in last.content)):
            return {}
        return {"add_generation_prompt": False, "continue_final_message": True}

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as chat's function tools; ValueError names the tool."""
        if self.tools is None:
            return None
        return [_chat_tool(f"tools.{i}", t) for i, t in enumerate(self.tools)]

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if not choice.name:
                raise ValueError("tool_choice.name: a tool choice of type 'tool' needs the "
                                 "tool's name")
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def response_format(self) -> dict[str, Any] | None:
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        return {"type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt.schema_}}


class MessagesRequest(_AnthropicBody):
    """The body of ``POST /v1/messages``: what forerun reads of Anthropic's fields."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Anthropic's ranges; unset, Anthropic's defaults (temperature 1.0, no top_p / top_k).
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    # One tier, no region: accepted and ignored. cache_control: prefix caching is automatic.
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None

    def to_chat(self, extra: dict[str, Any] | None = None) -> AnthropicChatRequest:
        """The chat completion this request amounts to, with ``extra`` chat fields (the
        thinking's); ValueError names the field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be at least 1, got {self.max_tokens}")
        t = self._thinking
        if t is not None and t.type == "enabled" and t.budget_tokens is not None and \
                t.budget_tokens >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens: must be less than max_tokens "
                             f"({self.max_tokens}), got {t.budget_tokens}")
        user = (self.metadata or {}).get("user_id")
        fields: dict[str, Any] = {
            "model": self.model, "messages": self.chat_messages(),
            "max_tokens": self.max_tokens, "temperature": self.temperature,
            # top_k 0 samples from every token, as no top_k does.
            "top_p": self.top_p, "top_k": self.top_k or None, "stop": self.stop_sequences,
            "stream": self.stream, "response_format": self.response_format(),
            "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
            "user": user if isinstance(user, str) else None, **self.template_fields(),
            **(extra or {}),
        }
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        try:
            return AnthropicChatRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise ValueError(validation_message(exc, AnthropicChatRequest)) from None


class CountTokensRequest(_AnthropicBody):
    """The body of ``POST /v1/messages/count_tokens``: a conversation, no sampling."""

    def to_chat(self, extra: dict[str, Any] | None = None) -> AnthropicChatRequest:
        return AnthropicChatRequest.model_validate(
            {"model": self.model, "messages": self.chat_messages(),
             "tools": self.chat_tools(), **self.template_fields(), **(extra or {})})


class AnthropicChatRequest(ChatCompletionRequest):
    """The chat request a Messages request runs as; errors use the Anthropic names."""

    engine_field_names: ClassVar[dict[str, str]] = {
        "stop": "stop_sequences", "prompt": "messages", "prompt_token_ids": "messages",
        "structured_outputs.json": "output_config.format.schema",
        "response_format.json_schema.schema": "output_config.format.schema",
        "response_format": "output_config.format",
        "structured_outputs": "output_config.format"}


def validation_message(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """pydantic's first error as Anthropic words it: ``messages.0.role: Input should be
    'user' or 'assistant'`` (the path dotted, union member names left out)."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if not _union_member(str(p))]
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {msg}"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if model is not None:
        msg = model.api_error_text(msg) if hasattr(model, "api_error_text") else msg
    path = ".".join("schema" if p == "schema_" else p for p in loc)
    return f"{path}: {msg}" if path and not msg.startswith(path) else msg


def _union_member(part: str) -> bool:
    # pydantic names the members of a union in an error's location: "str", "list[...]".
    return part in ("str", "int", "float", "bool", "dict", "none") or (
        part.endswith("]") and "[" in part) or part.startswith("function-")


def _text_of(where: str, block: dict[str, Any]) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text: a text block needs a string text")
    return text


def _tool_result_text(where: str, block: dict[str, Any]) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: must be a string or a list of text blocks")
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"{where}.content.{j}.type: only text blocks are supported in "
                             f"a tool_result (this server's models read text only), got "
                             f"{kind!r}")
        pieces.append(_text_of(f"{where}.content.{j}", part))
    return "".join(pieces)


def _chat_turn(where: str, m: MessageParam, reasoning: bool = False) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: tool results become ``tool`` messages (in
    order), the rest of a user turn one user message, an assistant turn one message
    holding its text and its ``tool_calls`` (its thinking blocks dropped when the server
    has a reasoning parser)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content.{j}"
        kind = block.get("type")
        if kind == "text":
            text.append(_text_of(at, block))
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise ValueError(f"{at}: a tool_use block needs a string id and name")
            if not isinstance(block.get("input"), dict):
                raise ValueError(f"{at}.input: a tool_use block's input must be an object")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise ValueError(f"{at}.tool_use_id: a tool_result block needs the id of "
                                 "its tool_use")
            if text:  # keep the order of the turn's pieces
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _tool_result_text(at, block)})
        elif kind in _THINKING_BLOCKS and m.role == "assistant" and reasoning:
            continue  # an earlier reply's thinking: templates leave it out
        elif kind in _MEDIA:
            raise ValueError(f"{at}.type: {kind} blocks are not supported: this server's "
                             "models read text only")
        else:
            allowed = "text, tool_use" if m.role == "assistant" else "text, tool_result"
            if m.role == "assistant" and reasoning:
                allowed += ", thinking"
            raise ValueError(f"{at}.type: a {m.role} turn may hold {allowed} blocks here, "
                             f"got {kind!r}")
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _chat_tool(where: str, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise ValueError(f"{where}: must be a tool object")
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise ValueError(f"{where}.type: only client tools (name, description, "
                         f"input_schema) are supported; server tools such as {kind!r} are "
                         "not")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: a tool needs a non-empty name")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.input_schema: a tool needs a JSON schema object")
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}
