"""Messages between the API process and the engine-core process (msgpack via msgspec).

Requests cross as token ids plus sampling parameters: tokenising and detokenising stay in
the API process, so the core process only schedules and runs the model.
"""

from __future__ import annotations

from typing import Any

import msgspec

from forerun.core.output import EngineCoreOutput, TokenLogprobs
from forerun.core.stats import EngineStats
from forerun.sampling_params import SamplingParams


class WireSamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """SamplingParams as they travel; ``all_stop_token_ids`` already holds the EOS ids."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    all_stop_token_ids: list[int]
    # StructuredOutputsParams.to_dict(): plain values, rebuilt (and compiled) in the core.
    structured_outputs: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] = []
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireSamplingParams:
        so = p.structured_outputs
        return cls(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, list(p.stop or []),
                   list(p.stop_token_ids or []), p.ignore_eos, p.min_tokens,
                   p.skip_special_tokens, p.spaces_between_special_tokens,
                   p.include_stop_str_in_output, sorted(p.all_stop_token_ids),
                   so.to_dict() if so is not None else None,
                   p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p,
                   p.logit_bias, p.allowed_token_ids, p.bad_words, p.bad_words_token_ids,
                   p.logprobs, p.prompt_logprobs)

    def to_params(self) -> SamplingParams:
        p = SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )
        p._all_stop_token_ids = set(self.all_stop_token_ids)
        p._bad_words_token_ids = [list(w) for w in self.bad_words_token_ids]
        return p


# ----- API process -> core ---------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A validated, tokenised request."""

    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    arrival_time: float


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats", array_like=True):
    call_id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | AbortRequests | GetStats | Shutdown


# ----- core -> API process ---------------------------------------------------------------
class WireOutput(msgspec.Struct, array_like=True):
    """One request's result of one step; ``first_scheduled_time`` rides on its first output."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    first_scheduled_time: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def to_core_output(self) -> EngineCoreOutput:
        return EngineCoreOutput(self.request_id, self.new_token_ids, self.finish_reason,
                                self.stop_reason, self.num_cached_tokens, self.logprobs,
                                self.prompt_logprobs)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    # The core may lower max_model_len to what its KV cache holds; the frontend adopts it.
    max_model_len: int


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    error: str
    traceback: str


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """Everything one engine step produced, sent as one message."""

    outputs: list[WireOutput]


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True):
    call_id: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag="core_failed", array_like=True):
    """The core loop raised; the core process exits after sending this."""

    error: str
    traceback: str


CoreMessage = Ready | StartupFailed | CoreOutputs | StatsReply | CoreFailed

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)
