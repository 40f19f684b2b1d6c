"""Beam search above the engine, as vLLM does it: one engine request per beam per step.

Each round every live beam is submitted as a request for one token with ``2 * beam_width``
logprobs; the candidates (each beam extended by each listed token) are ranked by
cumulative logprob and the best ``beam_width`` live on. A candidate ending in an EOS token
(unless ``ignore_eos``) is finished and set aside. When ``max_tokens`` rounds are done, the
finished and the live beams are ranked by vLLM's length-penalised score,
``cumulative_logprob / len(tokens) ** length_penalty`` (``tokens``: prompt and output, a
final EOS not counted), and the best ``beam_width`` are returned. Prefix caching makes the
rounds cheap: each request's prompt is its beam, whose blocks are already cached.

``BeamSearch`` is the algorithm alone (which prompts to run, what to do with their
logprobs); :func:`beam_search_sync` drives it with ``LLM.generate`` and
:class:`BeamSearchStream` with ``AsyncLLM.generate`` (the server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forerun.outputs import CompletionOutput, PositionLogprobs, RequestOutput

# BeamSearchParams lives beside SamplingParams, as in vLLM; it is importable from here too.
from forerun.sampling_params import BeamSearchParams, SamplingParams  # noqa: I001

if TYPE_CHECKING:
    from forerun.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "BeamSearchStream", "beam_search_sync", "check_beam_search"]


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and the generated ones (vLLM's shape)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(seq: BeamSearchSequence, eos_token_ids: frozenset[int],
               length_penalty: float) -> float:
    """vLLM's ranking score: the cumulative logprob over the length to a power."""
    n = len(seq.tokens)
    if seq.tokens and seq.tokens[-1] in eos_token_ids and seq.finish_reason == "stop":
        n -= 1
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """The search for one prompt: ask :meth:`pending`, run them, give :meth:`advance`."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_ids: Sequence[int]) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)
        n = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids), num_prompt_tokens=n)]
        self.finished: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        """The prompts of this round: every live beam's tokens."""
        return [b.tokens for b in self.live]

    def advance(self, logprobs: Sequence[PositionLogprobs]) -> None:
        """Extend every live beam by the tokens its request listed; keep the best."""
        assert len(logprobs) == len(self.live)
        width = self.params.beam_width
        candidates: list[BeamSearchSequence] = []
        for beam, pos in zip(self.live, logprobs, strict=True):
            for tid, lp in pos.items():
                seq = BeamSearchSequence(beam.tokens + [tid], beam.cum_logprob + lp.logprob,
                                         num_prompt_tokens=beam.num_prompt_tokens)
                if tid in self.eos and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.finished.append(seq)
                else:
                    candidates.append(seq)
        # Same length within a round, so the cumulative logprob ranks them; ties go to
        # the lower token id, then the earlier beam, so the order is deterministic.
        candidates.sort(key=lambda s: (-s.cum_logprob, s.tokens[-1]))
        self.live = candidates[:width]
        self.steps += 1

    def result(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The best ``beam_width`` of the finished and live beams, best first."""
        for b in self.live:
            b.finish_reason = "length"
        pool = self.finished + self.live
        pool.sort(key=lambda s: -beam_score(s, self.eos, self.params.length_penalty))
        best = pool[:self.params.beam_width]
        if decode is not None:
            for b in best:
                out = b.output_token_ids
                if b.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    out = out[:-1]
                b.text = decode(out)
        return BeamSearchOutput(best)


def _position(out: RequestOutput) -> PositionLogprobs:
    (c,) = out.outputs
    assert c.logprobs is not None and c.logprobs, "a beam step returned no logprobs"
    return c.logprobs[0]


def check_beam_search(params: BeamSearchParams, prompt_len: int, max_model_len: int,
                      logprobs_limit: int) -> None:
    """ValueErrors naming the field for a search that cannot run."""
    if 2 * params.beam_width > logprobs_limit:
        raise ValueError(
            f"n: beam search of width {params.beam_width} asks for "
            f"{2 * params.beam_width} logprobs per step, which is greater than max "
            f"allowed: {logprobs_limit} (--max-logprobs)")
    if prompt_len + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: the prompt has {prompt_len} tokens and {params.max_tokens} more "
            f"do not fit the model's context length of {max_model_len} tokens")


def beam_search_sync(generate: Callable[[list[Any], SamplingParams], list[RequestOutput]],
                     prompts: list[list[int]], params: BeamSearchParams,
                     eos_token_ids: Sequence[int],
                     decode: Callable[[list[int]], str] | None = None,
                     ) -> list[BeamSearchOutput]:
    """Every prompt's search, their rounds batched together through ``generate``.

    As vLLM's ``LLM.beam_search``, each sequence's ``text`` is ``decode`` of all its
    tokens, the prompt's included.
    """
    searches = [BeamSearch(p, params, eos_token_ids) for p in prompts]
    step = params.step_params()
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            break
        batch = [(s, toks) for s in live for toks in s.pending()]
        outs = generate([{"prompt_token_ids": toks} for _, toks in batch], step)
        i = 0
        for s in live:
            k = len(s.live)
            s.advance([_position(o) for o in outs[i:i + k]])
            i += k
    results = [s.result() for s in searches]
    if decode is not None:
        for r in results:
            for b in r.sequences:
                b.text = decode(b.tokens)
    return results


class BeamSearchStream:
    """A server request run as a beam search, read like a ``RequestStream``: it yields
    one ``RequestOutput`` at the end, with the ``beam_width`` best as its ``n`` outputs."""

    def __init__(self, engine: AsyncLLM, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], params: BeamSearchParams,
                 skip_special_tokens: bool = True) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.skip_special_tokens = skip_special_tokens
        self.finished = False
        self._round = 0

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            return await self._run()
        finally:
            self.finished = True

    async def _one(self, tokens: list[int], params: SamplingParams, rid: str
                   ) -> PositionLogprobs:
        last = None
        async for out in self.engine.generate({"prompt_token_ids": tokens}, params, rid):
            last = out
        assert last is not None
        return _position(last)

    async def _run(self) -> RequestOutput:
        engine = self.engine
        search = BeamSearch(self.prompt_token_ids, self.params,
                            engine.processor.eos_token_ids)
        step = self.params.step_params()  # checked by each add_request
        while not search.done:
            r = self._round
            self._round += 1
            # Cancelling this task (client gone) cancels every generate, which aborts
            # its request: no KV block outlives the search.
            positions = await asyncio.gather(*(
                self._one(toks, step, f"{self.request_id}-beam{r}-{i}")
                for i, toks in enumerate(search.pending())))
            search.advance(positions)
        skip = self.skip_special_tokens

        def decode(ids: list[int]) -> str:
            return engine.tokenizer.decode(ids, skip_special_tokens=skip)

        best = search.result(decode)
        outputs = [CompletionOutput(i, b.text or "", b.output_token_ids, b.cum_logprob,
                                    finish_reason=b.finish_reason)
                   for i, b in enumerate(best.sequences)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=True)

    def abort(self) -> None:
        """Nothing to do here: a cancelled search's requests abort themselves."""
        self.finished = True
