"""OpenAI request bodies (pydantic, validated by FastAPI) and how they map to SamplingParams."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from forerun.sampling_params import SamplingParams
from forerun.server.structured import structured_outputs_of

logger = logging.getLogger(__name__)

# OpenAI fields we do not implement, with the values that mean "off": those are accepted,
# anything else is a 400 naming the field rather than a silently different result.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
}


# Strict: a JSON value of the wrong type is a 400 naming the field, never coerced (true is
# not 1, "5" is not 5, a string is not a one-element list); a JSON integer is still a valid
# float. Python's json module reads NaN and Infinity, which no sampling field may hold.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_bad_text(body: dict[Any, Any]) -> str | None:
    """The field holding the first string (or key) UTF-8 cannot encode, if any.

    A lone surrogate escape (JSON "\\ud800") is refused as invalid JSON by pydantic's JSON
    parser, which the server uses; Python's json module accepts it, and a body validated
    from Python objects would carry a str that the tokenizer and the response encoder
    reject with a 500 later. Found here, once, for every field: chat messages are named by
    their path (``messages[0].content``), other fields by name; a name that is itself bad
    is shown escaped, as the error must be encodable too.
    """
    stack: list[tuple[str, bool, Any]] = []
    for key, value in body.items():
        name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
        stack.append((name, name == "messages", key))
        stack.append((name, name == "messages", value))
    while stack:
        path, deep, v = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append((path, deep, k))
                sub = str(k).encode("utf-8", "backslashreplace").decode("utf-8")
                stack.append((f"{path}.{sub}" if deep else path, deep, item))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                stack.append((f"{path}[{i}]" if deep else path, deep, item))
    return None


class _BaseRequest(BaseModel):
    """Fields shared by completions and chat completions.

    Types are strict (see ``_STRICT``); ranges are checked once, by SamplingParams, whose
    ValueErrors name the field as well.
    """

    # Unknown fields are ignored (with a log line), like OpenAI ignores what it doesn't know.
    model_config = ConfigDict(extra="allow", **_STRICT)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (forerun/server/structured.py): at most one of these.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Logit processing: OpenAI's names, then vLLM's extras.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # vLLM's extra: keep only the prompt's last k tokens (-1: as many as the model takes).
    truncate_prompt_tokens: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _reject_bad_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            path = _first_bad_text(data)
            if path is not None:
                raise ValueError(f"{path}: is not valid Unicode text (it holds a lone "
                                 "surrogate, which UTF-8 cannot encode)")
        return data

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _BaseRequest:
        extra = self.model_extra or {}
        for name, value in extra.items():
            allowed = _UNSUPPORTED_DEFAULTS.get(name)
            if allowed is None:
                logger.info("ignoring unknown request field %r", name)
            elif value not in allowed:
                raise ValueError(f"{name}: is not supported by this server (got {value!r})")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_logprobs(self) -> int | None:
        """Top-N logprobs per output token, None for none (the endpoints differ)."""
        return None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias: keys must be token ids") from None

    def truncation(self, max_model_len: int) -> int | None:
        """How many prompt tokens to keep (None: all); ValueError names the field."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        if k == -1:
            return max_model_len
        if k < 1:
            raise ValueError(f"truncate_prompt_tokens: must be -1 or at least 1, got {k}")
        return k

    def sampling_params(self, max_tokens: int | None,
                        truncate_prompt_tokens: int | None = None) -> SamplingParams:
        """SamplingParams for this body; ValueErrors start with the offending field."""
        return SamplingParams(
            truncate_prompt_tokens=truncate_prompt_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=self._logit_bias(),
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.prompt_logprobs,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            structured_outputs=structured_outputs_of({
                "response_format": self.response_format,
                "structured_outputs": self.structured_outputs,
                "guided_json": self.guided_json, "guided_regex": self.guided_regex,
                "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
            }),
        )


class CompletionRequest(_BaseRequest):
    """``POST /v1/completions``: prompt is text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_BaseRequest):
    """``POST /v1/chat/completions``; messages are checked by the chat-template helpers."""

    messages: Any
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}.")
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs to be true")
            return None
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """Split a completions ``prompt`` into engine prompts, one per choice."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt: must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": list(p)} for p in prompt]  # type: ignore[arg-type]
    raise ValueError("prompt: must be a string, a list of strings, or token ids")
