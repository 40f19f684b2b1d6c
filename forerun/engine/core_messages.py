"""Messages between the API process and the engine-core process (msgpack via msgspec).

Requests cross as token ids plus sampling parameters: tokenising and detokenising stay in
the API process, so the core process only schedules and runs the model.
"""

from __future__ import annotations

from typing import Any

import msgspec

from forerun.core.output import EngineCoreOutput, TokenLogprobs
from forerun.core.stats import EngineStats
from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams


# ----- API process -> core ---------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A validated, tokenised request.

    ``params`` is forerun's own SamplingParams, encoded by its dataclass fields (private
    ones too: ``all_stop_token_ids`` already holds the EOS ids); decoding re-runs its
    validation. One type on both sides, so a new field cannot be left off the wire.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # A pooling request (prefill-only; ``params`` is then a placeholder never sampled).
    pooling_params: PoolingParams | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats", array_like=True):
    call_id: int
    # Include the step spans of this many recent seconds (0: none).
    span_window_s: float = 0.0


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
    pooling_output: list[float] | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def to_core_output(self) -> EngineCoreOutput:
        return EngineCoreOutput(self.request_id, self.new_token_ids, self.finish_reason,
                                self.stop_reason, self.num_cached_tokens, self.logprobs,
                                self.prompt_logprobs, self.pooling_output,
                                self.kv_transfer_params)


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
    engine_index: int = 0  # the core's data-parallel rank


class CoreFailed(msgspec.Struct, tag="core_failed", array_like=True):
    """The core loop raised; the core process exits after sending this."""

    error: str
    traceback: str


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The core loop is alive: sent when nothing else went out for HEARTBEAT_INTERVAL_S.

    Sent from the loop itself, not a side thread, so a core stuck inside a step stops
    beating too and the API process can report it unhealthy.
    """


# Generous against the idle poll: a beat is due at least every second.
HEARTBEAT_INTERVAL_S = 1.0

CoreMessage = Ready | StartupFailed | CoreOutputs | StatsReply | CoreFailed | Heartbeat

input_encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(CoreMessage)
