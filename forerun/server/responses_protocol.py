"""``POST /v1/responses`` bodies (OpenAI's Responses API) and their mapping onto chat.

A Responses request is run as the chat completion it amounts to: ``instructions`` and
``input`` become messages, ``max_output_tokens`` is ``max_tokens``, ``text.format`` is
``response_format``, ``reasoning.effort`` is ``reasoning_effort`` and the flat function
tools become chat's nested ones. Errors name the Responses field
(``input[1].content[0].type``, ``max_output_tokens``, ``text.format``).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import ConfigDict, model_validator

from forerun.server.protocol import (
    ChatCompletionRequest,
    TextCheckedRequest,
    check_extra_fields,
)

logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# Fields the server does not implement, with the values that mean "as if absent".
# ``store`` is accepted as OpenAI's default true but nothing is stored (no GET
# /v1/responses/{id}); ``previous_response_id`` needs a store, so it is refused.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "conversation": (None,),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "service_tier": (None, "auto", "default"),
}
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_WHY = {"previous_response_id": "responses are not stored by this server (store is not "
                                "supported), so there is none to continue from"}

# reasoning.effort's values: those of chat's reasoning_effort.
_EFFORTS = ("low", "medium", "high")
# Content part types that carry text, by the role that may send them.
_TEXT_PARTS = ("input_text", "output_text", "text")
# Responses roles as the chat template knows them.
_ROLES = {"developer": "system"}


class ResponsesRequest(TextCheckedRequest):
    """The body of ``POST /v1/responses``: what forerun reads of OpenAI's fields."""

    model_config = _STRICT

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extras, which its Responses endpoint takes as well.
    seed: int | None = None
    top_k: int | None = None
    # Only "message.output_text.logprobs" (the text's logprobs, with top_logprobs each).
    include: list[str] | None = None
    top_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    # {"effort": ..., "summary": ...}: the effort goes to the chat template as chat's
    # reasoning_effort; no summary is written (a reasoning item's summary stays []).
    reasoning: dict[str, Any] | None = None

    def wants_logprobs(self) -> bool:
        """``include`` checked: True when it asks for the output text's logprobs."""
        other = [x for x in self.include or () if x != _LOGPROBS_INCLUDE]
        if other:
            raise ValueError(f"include: only {_LOGPROBS_INCLUDE!r} is supported, got "
                             f"{other[0]!r}")
        return bool(self.include)

    @model_validator(mode="after")
    def _reject_unsupported(self) -> ResponsesRequest:
        check_extra_fields(self.model_extra, _UNSUPPORTED, _WHY)
        return self

    def messages(self) -> list[dict[str, Any]]:
        """``instructions`` then ``input`` as chat messages; ValueError names the item."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            return out
        if not self.input:
            raise ValueError("input: must not be empty")
        before = len(out)
        for i, item in enumerate(self.input):
            message = _message_of(f"input[{i}]", item)
            if message is not None:
                out.append(message)
        if len(out) == before:
            raise ValueError("input: holds only reasoning items; there is no message to "
                             "answer")
        return out

    def text_format(self) -> dict[str, Any]:
        """``text.format`` (``{"type": "text"}`` when absent), checked."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                                 "json_schema"):
            raise ValueError("text.format: must be an object whose type is 'text', "
                             "'json_object' or 'json_schema'")
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format.schema: a json_schema format needs a schema object")
        return fmt

    def _response_format(self) -> dict[str, Any] | None:
        fmt = self.text_format()
        if fmt["type"] == "json_schema":
            return {"type": "json_schema",
                    "json_schema": {"name": fmt.get("name", "response"),
                                    "schema": fmt["schema"]}}
        return None if fmt["type"] == "text" else {"type": fmt["type"]}

    def _reasoning_effort(self) -> str | None:
        """``reasoning.effort``, checked: what chat's ``reasoning_effort`` takes."""
        reasoning = self.reasoning or {}
        unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
        if unknown:
            raise ValueError(f"reasoning.{unknown[0]}: not supported (only effort and "
                             "summary)")
        effort = reasoning.get("effort")
        if effort is not None and effort not in _EFFORTS:
            raise ValueError(f"reasoning.effort: must be one of {', '.join(_EFFORTS)}, got "
                             f"{effort!r}")
        return effort

    def _chat_tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise ValueError(f"tools[{i}].type: only function tools are supported, got "
                                 f"{tool.get('type')!r}")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise ValueError(f"tools[{i}].name: a function tool needs a name")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                  if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def _chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise ValueError('tool_choice: must be "none", "auto", "required" or '
                         '{"type": "function", "name": ...}')

    def to_chat(self) -> ResponsesChatRequest:
        """The chat completion this request amounts to; ValueError names the field."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": self.messages(),
            "max_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "stream": self.stream, "seed": self.seed,
            "top_k": self.top_k, "response_format": self._response_format(),
            "tools": self._chat_tools(), "tool_choice": self._chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
            "return_tokens_as_token_ids": self.return_tokens_as_token_ids,
            "reasoning_effort": self._reasoning_effort(),
        }
        if self.wants_logprobs():
            fields.update(logprobs=True, top_logprobs=self.top_logprobs)
        elif self.top_logprobs:
            raise ValueError(f"top_logprobs: needs include [{_LOGPROBS_INCLUDE!r}]")
        return ResponsesChatRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None})


class ResponsesChatRequest(ChatCompletionRequest):
    """The chat request a Responses request runs as; errors use the Responses names."""

    engine_field_names: ClassVar[dict[str, str]] = {
        "max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
        "prompt_token_ids": "input",
        "structured_outputs.json": "text.format.schema", "response_format": "text.format",
        "structured_outputs": "text.format"}


def _message_of(where: str, item: Any) -> dict[str, Any] | None:
    """One input item as a chat message: a message, a function call or its output; None
    for a reasoning item (an earlier turn's thinking, which a client sends back with the
    rest of the output: chat templates leave earlier thinking out of the prompt)."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: must be an object (a message or a function call item)")
    kind = item.get("type", "message")
    if kind == "reasoning":
        return None
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ValueError(f"{where}.{key}: a function_call item needs a string {key}")
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise ValueError(f"{where}: a function_call_output item needs a string call_id "
                             "and output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    if kind != "message":
        raise ValueError(f"{where}.type: must be 'message', 'function_call', "
                         f"'function_call_output' or 'reasoning', got {kind!r}")
    role = item.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role: a message needs a role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                    or not isinstance(part.get("text"), str):
                got = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{j}].type: only text parts "
                                 f"(input_text, output_text) are supported, got {got!r}")
            pieces.append(part["text"])
        text = "".join(pieces)
    else:
        raise ValueError(f"{where}.content: must be a string or a list of content parts")
    return {"role": _ROLES.get(role, role), "content": text}
