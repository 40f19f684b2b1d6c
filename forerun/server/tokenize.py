"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``, with vLLM's request and reply shapes.

A tokenize body with ``messages`` is a chat request (rendered by the chat template, then
tokenised); one with ``prompt`` is plain text. Neither is checked against the context
length: the reply's ``max_model_len`` lets the client do that.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from pydantic import BaseModel, ConfigDict

from forerun.engine.chat import render_chat
from forerun.sampling_params import check_token_ids
from forerun.server.edge import parse_body
from forerun.server.errors import APIError
from forerun.server.serving import ServingContext, check_model

# vLLM ignores fields it does not know in these bodies; so do we. Types are strict.
_CONFIG = ConfigDict(strict=True, extra="ignore")


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a text prompt."""

    model_config = _CONFIG

    model: str | None = None
    prompt: str
    # BOS and the like, as a completion request's prompt gets them.
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat messages, rendered by the chat template."""

    model_config = _CONFIG

    model: str | None = None
    messages: Any
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template writes the special tokens itself; adding them again would double BOS.
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = _CONFIG

    model: str | None = None
    tokens: list[int]


def parse_tokenize(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as a chat request when it has ``messages``, else as a text one."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError.bad_request("the body is not valid JSON") from None
    if isinstance(data, dict) and "messages" in data:
        return parse_body(TokenizeChatRequest, raw)
    return parse_body(TokenizeCompletionRequest, raw)


def tokenize(ctx: ServingContext,
             body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """``{count, max_model_len, tokens, token_strs}`` as vLLM answers."""
    check_model(ctx, body.model)
    tok = ctx.engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        if body.add_generation_prompt and body.continue_final_message:
            raise APIError.bad_request(
                "continue_final_message: cannot be true with add_generation_prompt true",
                "continue_final_message")
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        try:
            text = render_chat(tok, body.messages, body.add_generation_prompt,
                               body.chat_template, body.tools, **kwargs)
        except ValueError as exc:
            raise APIError.bad_request(str(exc)) from None
        except jinja2.TemplateError as exc:
            raise APIError.bad_request(f"messages: the chat template rejected them: {exc}",
                                       "messages") from None
    else:
        text = body.prompt
    try:
        ids = list(tok.encode(text, add_special_tokens=body.add_special_tokens))
    except TypeError as exc:  # a lone surrogate the tokenizer cannot take
        raise APIError.bad_request(f"prompt: {exc}", "prompt") from None
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.engine.max_model_len,
                             "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        reply["token_strs"] = tok.convert_ids_to_tokens(ids)
    return reply


def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> dict[str, Any]:
    """``{prompt}``: the text of ``tokens``, special tokens kept (as vLLM)."""
    check_model(ctx, body.model)
    vocab = ctx.engine.processor.vocab_size
    try:
        ids = check_token_ids("tokens", body.tokens)
    except ValueError as exc:
        raise APIError.bad_request(str(exc), "tokens") from None
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise APIError.bad_request(
            f"tokens: token id {bad} is out of the vocabulary (size {vocab})", "tokens")
    return {"prompt": ctx.engine.tokenizer.decode(ids)}


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """The tokenizer's class and its JSON-representable settings, chat template included."""
    tok = ctx.engine.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    for key, value in (getattr(tok, "init_kwargs", None) or {}).items():
        plain = _jsonable(value)
        if plain is not _SKIP:
            info[key] = plain
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


_SKIP = object()


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (added tokens as their text), or ``_SKIP``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    if isinstance(content, str):
        return content
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, dict):
        out = {str(k): _jsonable(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in out.values()) else out
    return _SKIP
