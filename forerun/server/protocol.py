"""OpenAI request bodies (pydantic, validated by FastAPI) and how they map to SamplingParams."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from forerun.sampling_params import ALL_LOGPROBS, INT64_MAX, SamplingParams
from forerun.server.structured import structured_outputs_of

logger = logging.getLogger(__name__)

# OpenAI and vLLM fields we do not implement, with the values that mean "off": those are
# accepted, anything else is a 400 naming the field rather than a silently different
# result. A field not listed here and not declared below is ignored with a log line, as
# vLLM ignores what it does not know. vLLM's names (its ``CompletionRequest`` and
# ``ChatCompletionRequest`` extras) are listed so a vLLM client learns what it lacks.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    # vLLM's sampling extras.
    "logits_processors": (None, []),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "logprob_token_ids": (None,),
    # vLLM's request extras.
    "prompt_embeds": (None,),
    "priority": (None, 0),
    "cache_salt": (None,),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "return_token_offsets": (None, False),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
}
# Extras of one endpoint only; where vLLM's default differs between the endpoints
# (add_special_tokens), so does the value that means "as forerun does it".
_COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (None, True),
}
_CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "add_special_tokens": (None, False),
    "chat_template": (None,),
}


# vLLM's protocol bounds these in the schema, so an out-of-range value is pydantic's
# greater_than_equal / less_than_equal error (its type is in the 400's message).
_INT64_MIN = -(2**63)


# Strict: a JSON value of the wrong type is a 400 naming the field, never coerced (true is
# not 1, "5" is not 5, a string is not a one-element list); a JSON integer is still a valid
# float. Python's json module reads NaN and Infinity, which no sampling field may hold.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


# Fields beam search cannot honour (each must be absent or off with use_beam_search).
_BEAM_SEARCH_FORBIDS = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "bad_words", "allowed_token_ids", "stop", "stop_token_ids", "min_tokens",
    "seed", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "tools")
# Values of those fields that mean "off" besides null and false (JSON ints are accepted
# where the field is a float: 1 for 1.0).
_BEAM_OFF: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0, 1), "repetition_penalty": (1.0, 1), "top_k": (-1,), "min_p": (0.0, 0),
    "presence_penalty": (0.0, 0), "frequency_penalty": (0.0, 0), "min_tokens": (0,),
    "stop": ([],), "stop_token_ids": ([],), "bad_words": ([],), "tools": ([],),
    "logit_bias": ({},)}


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


class TextCheckedRequest(BaseModel):
    """A request body whose strings (and keys) must all be encodable as UTF-8."""

    @model_validator(mode="before")
    @classmethod
    def _reject_bad_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            path = _first_bad_text(data)
            if path is not None:
                raise ValueError(f"{path}: is not valid Unicode text (it holds a lone "
                                 "surrogate, which UTF-8 cannot encode)")
        return data


class _BaseRequest(TextCheckedRequest):
    """Fields shared by completions and chat completions.

    Types are strict (see ``_STRICT``); ranges are checked once, by SamplingParams, whose
    ValueErrors name the field as well.
    """

    # Unknown fields are ignored (with a log line), like OpenAI ignores what it doesn't know.
    model_config = ConfigDict(extra="allow", **_STRICT)
    # Set by the server, never by a body: the --reasoning-parser whose reasoning the
    # request's structured output waits out (forerun/server/reasoning.py).
    _grammar_after_reasoning: str | None = PrivateAttr(default=None)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extras: prompt and output token ids in the response; logprobs' tokens shown
    # as ``token_id:<id>`` (null: the server's --return-tokens-as-token-ids).
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
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
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    # vLLM's beam search (forerun/beam_search.py): n is the beam width.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: instructions for the engine's KV connector (prefill/decode disaggregation).
    kv_transfer_params: dict[str, Any] | None = None

    # The endpoint's own unsupported extras, on top of _UNSUPPORTED_DEFAULTS.
    _endpoint_unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {}
    # SamplingParams fields this endpoint spells differently (for the engine's errors).
    engine_field_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def api_error_text(cls, message: str) -> str:
        """An engine ValueError's message with the field as this endpoint names it."""
        for engine_name, api_name in cls.engine_field_names.items():
            if message.startswith(engine_name) and message[len(engine_name):][:1] in (
                    ":", " ", ".", "["):
                return api_name + message[len(engine_name):]
        return message

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _BaseRequest:
        extra = self.model_extra or {}
        for name, value in extra.items():
            allowed = self._endpoint_unsupported.get(name, _UNSUPPORTED_DEFAULTS.get(name))
            if allowed is None:
                logger.info("ignoring unknown request field %r", name)
            # `in` alone would take 0 for False and 1.0 for True: the type must match too.
            elif not any(value == a and type(value) is type(a) for a in allowed):
                raise ValueError(f"{name}: is not supported by this server (got {value!r})")
        return self

    @model_validator(mode="after")
    def _check_stream_fields(self) -> _BaseRequest:
        # vLLM's rules: usage options only mean something for a stream, and prompt
        # logprobs are not streamed.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self

    @model_validator(mode="after")
    def _check_beam_search(self) -> _BaseRequest:
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty: only used with use_beam_search")
            return self
        # Beam search ranks by the model's own logprobs: what would change the step
        # requests' distributions, or that it does not produce, is a 400, not ignored.
        for name in _BEAM_SEARCH_FORBIDS:
            value = getattr(self, name, None)
            off = _BEAM_OFF.get(name, ())
            if value is not None and value is not False and not any(
                    value == o and type(value) is type(o) for o in off):
                raise ValueError(f"{name}: is not supported with use_beam_search")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def usage_wanted(self, force: bool = False) -> bool:
        """Whether a stream ends with a usage chunk (``force``: --enable-force-include-usage)."""
        return force or self.include_usage

    def continuous_usage(self, force: bool = False) -> bool:
        """Usage on every chunk: vLLM's ``continuous_usage_stats`` with usage on, or
        ``force`` (--enable-force-include-usage turns both on, as in vLLM)."""
        return force or (self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats))

    @property
    def tokens_as_ids(self) -> bool:
        return bool(self.return_tokens_as_token_ids)

    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine must compute (an echo may need them too)."""
        return _logprobs_count("prompt_logprobs", self.prompt_logprobs)

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

    def with_grammar_after_reasoning(self, parser_name: str) -> Any:
        """A copy whose structured output (if any) starts after ``parser_name``'s reasoning
        ends, unless the request asked for ``enable_in_reasoning``."""
        body = self.model_copy()
        body._grammar_after_reasoning = parser_name
        return body

    def _structured_outputs(self) -> Any:
        so = structured_outputs_of({
            "response_format": self.response_format,
            "structured_outputs": self.structured_outputs,
            "guided_json": self.guided_json, "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
        })
        if so is not None and self._grammar_after_reasoning is not None:
            so = dataclasses.replace(so, reasoning_parser=self._grammar_after_reasoning)
        return so

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
            prompt_logprobs=self.engine_prompt_logprobs(),
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
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            extra_args=None if self.kv_transfer_params is None
            else {"kv_transfer_params": self.kv_transfer_params},
            structured_outputs=self._structured_outputs(),
        )


class CompletionRequest(_BaseRequest):
    """``POST /v1/completions``: prompt is text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    _endpoint_unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _COMPLETION_UNSUPPORTED

    def num_logprobs(self) -> int | None:
        return _logprobs_count("logprobs", self.logprobs)

    def engine_prompt_logprobs(self) -> int | None:
        # An echo with logprobs shows the prompt's tokens with their top `logprobs` too.
        own = _logprobs_count("prompt_logprobs", self.prompt_logprobs)
        if self.echo and self.logprobs is not None:
            counts = (own or 0, self.num_logprobs() or 0)
            return ALL_LOGPROBS if ALL_LOGPROBS in counts else max(counts)
        return own


class ChatCompletionRequest(_BaseRequest):
    """``POST /v1/chat/completions``; messages are checked by the chat-template helpers."""

    messages: Any
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # Lax, as vLLM's ``bool | None``: true/false, 1/0 and their strings ("true") all count.
    logprobs: bool | None = Field(False, strict=False)
    top_logprobs: int | None = None
    # Tool calling (forerun/server/tool_calls.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's chat-template extras (forerun/server/chat.py passes them to the template).
    echo: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    # vLLM's switch: false drops the reasoning a --reasoning-parser splits off.
    include_reasoning: bool = True
    # OpenAI's effort, handed to the chat template as vLLM does (the built-in harmony
    # template of gpt-oss writes it into the system message; others may ignore it).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    _endpoint_unsupported: ClassVar[dict[str, tuple[Any, ...]]] = _CHAT_UNSUPPORTED
    # Chat's per-token count is top_logprobs; the engine calls it logprobs.
    engine_field_names: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def engine_prompt_logprobs(self) -> int | None:
        # As vLLM: an echo shows the prompt's logprobs, with the top_logprobs count.
        own = _logprobs_count("prompt_logprobs", self.prompt_logprobs)
        if own is None and self.echo:
            return _logprobs_count("top_logprobs", self.top_logprobs) or 0
        return own

    def num_logprobs(self) -> int | None:
        _logprobs_count("top_logprobs", self.top_logprobs)
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs: needs logprobs to be true")
            return None
        return self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def _logprobs_count(name: str, value: int | None) -> int | None:
    """A logprobs count as the engine takes it; ValueError names the field.

    vLLM reads -1 as "the whole vocabulary"; whether a count (or -1) is within the
    server's ``--max-logprobs`` is the engine processor's check.
    """
    if value is None or value >= 0 or value == ALL_LOGPROBS:
        return value
    raise ValueError(f"{name}: must be -1 (the whole vocabulary) or a count from 0, "
                     f"got {value}")


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


def check_extra_fields(extra: dict[str, Any] | None, unsupported: dict[str, tuple[Any, ...]],
                       why: dict[str, str]) -> None:
    """Fields a body has beyond its model: an unknown one is logged and ignored; a known
    unsupported one is a ValueError naming it unless its value is one ``unsupported``
    allows (``why`` says what the server does not do)."""
    for name, value in (extra or {}).items():
        allowed = unsupported.get(name)
        if allowed is None:
            logger.info("ignoring unknown request field %r", name)
        elif not any(value == a and type(value) is type(a) for a in allowed):
            reason = why.get(name, "is not supported by this server")
            raise ValueError(f"{name}: {reason} (got {value!r})")
