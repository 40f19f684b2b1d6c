"""Chat messages to prompt text and token ids via the model's chat template."""

from __future__ import annotations

import json
from typing import Any

# OpenAI's roles; any other non-empty role is passed to the template too, as vLLM does
# (templates such as Granite's know roles like "document").
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})



def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style chat messages; return copies with content as plain strings.

    Content given as a list of `{"type": "text", "text": ...}` parts is joined. Errors
    are ValueErrors naming the offending field, e.g. `messages[1].content[0].type`.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of message objects")
    return [_validate_message(i, m) for i, m in enumerate(messages)]


def _validate_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where}: must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}.role: must be a non-empty string such as one of "
                         f"{sorted(CHAT_ROLES)}, got {role!r}")
    out = dict(message)
    if role == "assistant" and isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_template_tool_call(c) for c in message["tool_calls"]]
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        # OpenAI allows a null content next to tool calls; templates concatenate it.
        out["content"] = ""
    elif isinstance(content, str):
        pass
    elif isinstance(content, list):
        out["content"] = "".join(
            _text_of_part(f"{where}.content[{j}]", part) for j, part in enumerate(content)
        )
    else:
        raise ValueError(
            f"{where}.content: must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    return out


def _template_tool_call(call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; templates (Qwen's, Hermes') expect the
    object, so text that parses as one is handed over parsed, as vLLM does."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": parsed}}


def _text_of_part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"{where}: must be an object, got {type(part).__name__}")
    if part.get("type") != "text":
        raise ValueError(
            f"{where}.type: only 'text' content parts are supported, got {part.get('type')!r}"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text: must be a string, got {type(text).__name__}")
    return text


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render messages to prompt text with `chat_template` or the tokenizer's own.

    Extra keyword arguments are passed to the template (e.g. `continue_final_message`,
    `documents`, or template variables such as `enable_thinking`).
    """
    normalized = validate_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template=... (a Jinja string) "
            "or use the completions API with a plain prompt"
        )
    text = tokenizer.apply_chat_template(
        normalized,
        tools=tools,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    if not isinstance(text, str):
        raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> list[int]:
    """Render messages with the chat template and tokenize them into prompt token ids."""
    text = render_chat(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tools=tools,
        **kwargs,
    )
    # Templates write BOS and other special tokens themselves; letting the tokenizer add
    # them again would give a doubled BOS.
    return list(tokenizer.encode(text, add_special_tokens=False))
