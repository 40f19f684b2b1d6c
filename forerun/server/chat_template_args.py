"""What a chat request hands its chat template, and vLLM's rules for the reply's role and
``echo``: ``add_generation_prompt``, ``continue_final_message``, ``documents``, ``tools``
and ``chat_template_kwargs`` (which may override the others, as in vLLM)."""

from __future__ import annotations

from typing import Any

from forerun.server.errors import APIError
from forerun.server.protocol import ChatCompletionRequest

# Arguments of transformers' apply_chat_template that are not template variables: a
# request may not set them through chat_template_kwargs.
_RESERVED = frozenset({"conversation", "messages", "chat_template", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_kwargs(body: ChatCompletionRequest,
                    tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Keyword arguments for ``apply_chat_template``; 400 for contradictory ones."""
    kwargs: dict[str, Any] = {"add_generation_prompt": body.add_generation_prompt,
                              "continue_final_message": body.continue_final_message,
                              "tools": tools, "documents": body.documents}
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    extra = body.chat_template_kwargs or {}
    bad = sorted(k for k in extra if k in _RESERVED)
    if bad:
        raise APIError.bad_request(
            f"chat_template_kwargs: {', '.join(bad)} cannot be set here", "chat_template_kwargs")
    kwargs.update(extra)
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise APIError.bad_request(
            "continue_final_message: cannot be true together with add_generation_prompt "
            "(set add_generation_prompt to false)", "continue_final_message")
    return kwargs


def response_role(body: ChatCompletionRequest) -> str:
    """The reply's role: the assistant's after a generation prompt, else the last
    message's (the reply continues it), as vLLM decides."""
    if body.add_generation_prompt:
        return "assistant"
    last = body.messages[-1] if isinstance(body.messages, list) and body.messages else None
    role = last.get("role") if isinstance(last, dict) else None
    return role if isinstance(role, str) else "assistant"


def echo_text(body: ChatCompletionRequest) -> str:
    """With ``echo``, the text the reply starts with: the last message's content when it
    has the reply's role (the message being continued), else nothing."""
    if not body.echo or not isinstance(body.messages, list) or not body.messages:
        return ""
    last = body.messages[-1]
    if not isinstance(last, dict) or last.get("role") != response_role(body):
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""
