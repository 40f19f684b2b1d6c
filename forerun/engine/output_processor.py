"""Frontend side of the outputs: detokenise, apply stop strings, build RequestOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from forerun.core.output import EngineCoreOutput, TokenLogprobs
from forerun.engine.detokenizer import IncrementalDetokenizer
from forerun.engine.stop_checker import StopStringChecker
from forerun.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from forerun.pooling_params import PoolingParams, pooling_sampling_params
from forerun.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """Everything the frontend tracks for one request in flight."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    stop_checker: StopStringChecker | None
    metrics: RequestMetrics
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # A pooling request: its one output is a PoolingRequestOutput.
    pooling_params: PoolingParams | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def visible_text(self) -> str:
        """Text safe to show now: never a prefix of a stop string that may still match."""
        if self.stop_checker is None or self.finish_reason is not None:
            return self.text
        return self.text[: self.stop_checker.streamable_len(len(self.text), False)]

    def to_output(self, new_token_ids: list[int]) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text=self.visible_text(), token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, outputs=[completion],
            finished=self.finish_reason is not None, num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics, new_token_ids=new_token_ids,
            prompt_logprobs=self.prompt_logprobs, kv_transfer_params=self.kv_transfer_params,
        )


class OutputProcessor:
    """Turns engine-core outputs into RequestOutputs, and finds stop strings.

    A stop string ends a request here, in the frontend; the caller must then abort it in
    the engine core. Tokens the core produced meanwhile are dropped.
    """

    def __init__(self, tokenizer: object | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        checker = None
        if params.stop and detok is not None:
            checker = StopStringChecker(list(params.stop), params.include_stop_str_in_output)
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, detok, checker,
            RequestMetrics(arrival_time), [],
        )
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.request_states[request_id] = state

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int], params: PoolingParams,
                            arrival_time: float) -> None:
        """Track a pooling request: no detokenizer, no stop strings, one final output."""
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, pooling_sampling_params(), None, None,
            RequestMetrics(arrival_time), [], pooling_params=params)

    def abort_request(self, request_id: str) -> RequestState | None:
        return self.request_states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Return the outputs to hand out and the ids the core must abort."""
        now = time.monotonic()
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        to_abort: list[str] = []
        for out in core_outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # finished here already (stop string); late tokens are dropped
            if state.pooling_params is not None:
                if out.finish_reason is not None:
                    state.metrics.finished_time = now
                    del self.request_states[out.request_id]
                    outputs.append(PoolingRequestOutput(
                        out.request_id, PoolingOutput(out.pooling_output or []),
                        state.prompt_token_ids, True, out.num_cached_tokens,
                        out.finish_reason, state.prompt))
                continue
            if out.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            state.token_ids.extend(out.new_token_ids)
            if out.logprobs is not None and state.logprobs is not None:
                for entry in out.logprobs:
                    state.logprobs.append(self._position(entry))
                    state.cumulative_logprob = (state.cumulative_logprob or 0.0) \
                        + entry.logprobs[0]
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = [
                    None if e is None else self._position(e) for e in out.prompt_logprobs]
            new_chars = 0
            if state.detokenizer is not None:
                new_chars = len(state.detokenizer.update(out.new_token_ids))
                state.text = state.detokenizer.output_text
            stopped_by_string = self._check_stop_strings(state, new_chars)
            if out.finish_reason is not None and not stopped_by_string:
                state.finish_reason = out.finish_reason
                state.stop_reason = out.stop_reason
                state.kv_transfer_params = out.kv_transfer_params
            if stopped_by_string and out.finish_reason is None:
                to_abort.append(out.request_id)
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
            outputs.append(state.to_output(out.new_token_ids))
        return outputs, to_abort

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])  # type: ignore[attr-defined]

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        """The chosen token (with its own rank) first, then the top-N ranked 1..N."""
        ids, lps = entry.token_ids, entry.logprobs
        pos: PositionLogprobs = {ids[0]: Logprob(lps[0], entry.rank, self._decode(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            if t not in pos:
                pos[t] = Logprob(lp, r, self._decode(t))
        return pos

    def _check_stop_strings(self, state: RequestState, new_chars: int) -> bool:
        checker = state.stop_checker
        if checker is None or new_chars == 0:
            return False
        if len(state.token_ids) <= state.params.min_tokens:
            return False
        match = checker.check(state.text, new_chars)
        if match is None:
            return False
        truncate_to, stop_str = match
        state.text = state.text[:truncate_to]
        state.finish_reason = "stop"
        state.stop_reason = stop_str
        return True
