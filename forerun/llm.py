"""The offline API, mirroring ``vllm.LLM``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from forerun.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    beam_search_sync,
    check_beam_search,
)
from forerun.config import EngineConfig
from forerun.core.stats import EngineStats
from forerun.engine.chat import apply_chat_template
from forerun.engine.llm_engine import LLMEngine
from forerun.engine.processor import PromptType
from forerun.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams, check_text
from forerun.scoring import cosine, pair_texts

logger = logging.getLogger(__name__)


class LLM:
    """Generate from a batch of prompts with continuous batching and async scheduling.

    ``LLM()`` with no model loads the default SmolLM2-135M-Instruct. Keyword arguments
    are :class:`forerun.config.EngineConfig` fields (vLLM's names).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = EngineConfig(model=model, **kwargs)
        if config.data_parallel_size > 1:
            raise ValueError("data_parallel_size: the offline LLM runs one engine; serve "
                             "with `forerun serve --data-parallel-size N` for more")
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        Every request is validated before any is queued, so one bad prompt raises
        ``ValueError`` and nothing runs. Whatever interrupts the call afterwards (an error,
        a KeyboardInterrupt) aborts its requests before it propagates: the engine stays
        usable and every KV block is free again.
        """
        prompts = _prompt_list(prompts)
        params_list = _per_prompt("sampling_params", sampling_params or SamplingParams(),
                                  SamplingParams, len(prompts))
        engine = self.llm_engine
        # Check all first: a bad prompt must not leave half the batch queued.
        for p, sp in zip(prompts, params_list, strict=True):
            engine.processor.process_prompt(p, sp.truncate_prompt_tokens)
            engine.processor.process_params(sp)
        ids = self._submit("gen", prompts, params_list, engine.add_request)
        return self._run(ids, use_tqdm)  # type: ignore[return-value]

    def _submit(self, prefix: str, prompts: list[PromptType], params: list[Any],
                add: Any) -> list[str]:
        """Queue every (checked) prompt with ``add(request_id, prompt, params)``; whatever
        interrupts it aborts what it queued. Returns the request ids, in prompt order."""
        ids = [f"{prefix}-{next(self._counter)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, p, pp in zip(ids, prompts, params, strict=True):
                # Before the call, so that a request half added (a parallel-sampling
                # parent with some children) is aborted too; the ids are this call's own.
                added.append(rid)
                add(rid, p, pp)
        except BaseException:
            # The scheduler can still refuse one (more KV blocks than the cache holds).
            self._abort_and_drain(added)
            raise
        return ids

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation, or to a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        for conv in conversations:
            # The tokenizer raises TypeError on a lone surrogate; name the field instead.
            _check_texts("messages", conv)
        prompts: list[PromptType] = [
            {"prompt_token_ids": apply_chat_template(
                self.get_tokenizer(), conv, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template)}
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
               ) -> list[PoolingRequestOutput]:
        """Pool every prompt (prefill only, no sampling); outputs in prompt order.

        Works on a ``runner="pooling"`` engine and on a generating one alike (the same
        scheduler, the same path; vLLM refuses the latter). Every prompt is checked first.
        """
        prompts = _prompt_list(prompts)
        params_list = _per_prompt("pooling_params", pooling_params or PoolingParams(),
                                  PoolingParams, len(prompts))
        if truncate_prompt_tokens is not None:  # vLLM's keyword, over each request's own
            params_list = [dataclasses.replace(pp, truncate_prompt_tokens=truncate_prompt_tokens)
                           for pp in params_list]
        engine = self.llm_engine
        for p, pp in zip(prompts, params_list, strict=True):
            resolved = engine.processor.process_pooling_params(pp)
            engine.processor.process_prompt(p, resolved.truncate_prompt_tokens)
        ids = self._submit("pool", prompts, params_list, engine.add_pooling_request)
        outs = self._run(ids, use_tqdm)
        for out in outs:
            if out.finish_reason != "stop":  # type: ignore[union-attr]
                raise RuntimeError(f"pooling request {out.request_id} ended with "
                                   f"{out.finish_reason!r}")  # type: ignore[union-attr]
        return outs  # type: ignore[return-value]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one embedding per prompt (``.outputs.embedding``)."""
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for embedding models: the cosine similarity of each pair's
        embeddings (one ``text_1`` against every ``text_2``, or lists pairwise)."""
        pairs = pair_texts(text_1, text_2)
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        seconds = [b for _, b in pairs]
        outs = self.embed(firsts + seconds, pooling_params, truncate_prompt_tokens, use_tqdm)
        by_first = dict(zip(firsts, outs[: len(firsts)], strict=True))
        results = []
        for (a, _), eb in zip(pairs, outs[len(firsts):], strict=True):
            ea = by_first[a]
            results.append(ScoringRequestOutput(
                eb.request_id, ScoringOutput(cosine(ea.outputs.embedding, eb.outputs.embedding)),
                ea.prompt_token_ids + eb.prompt_token_ids))
        return results

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams, use_tqdm: bool = False,
                    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``beam_width`` best sequences of each prompt.

        Each round runs every live beam as a one-token request through :meth:`generate`
        (see :mod:`forerun.beam_search`); a sequence's ``tokens`` hold the prompt too, and
        its ``text`` is all of them decoded, as in vLLM. Every prompt is checked first.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        proc = engine.processor
        ids: list[list[int]] = []
        for p in prompts:
            toks = proc.process_prompt(p).prompt_token_ids
            check_beam_search(params, len(toks), proc.max_model_len, proc.logprobs_limit)
            ids.append(toks)
        tok = self.get_tokenizer()
        return beam_search_sync(
            lambda ps, sp: self.generate(ps, sp, use_tqdm=use_tqdm), ids, params,
            proc.eos_token_ids, lambda t: tok.decode(t))

    def _run(self, ids: list[str], use_tqdm: bool
             ) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        pending = set(ids)
        bar: Any = None
        # Everything after the requests were queued runs inside the try: even the progress
        # bar's construction may raise, and then they must be aborted too.
        try:
            engine.reset_stats_window()
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                       dynamic_ncols=True)
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
            # Steps still in flight belong to requests that already finished: retire them
            # so every block is free when generate returns.
            while engine.engine_core.has_work():
                engine.step()
        except BaseException:
            self._abort_and_drain(sorted(pending))
            raise
        finally:
            engine.close_stats_window()
            if bar is not None:
                bar.close()
            engine.write_trace()
        return [finished[i] for i in ids]

    def _abort_and_drain(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` and retire every step in flight, so every block is free.

        Called while an exception propagates; a second one here (another Ctrl-C) is logged
        and dropped so that the first reaches the caller. The engine core has retired its
        steps either way (EngineCore.run_step), and the next call drains what is left.
        """
        engine = self.llm_engine
        try:
            engine.abort_request(request_ids)
            while engine.engine_core.has_work():
                engine.step()
        except BaseException as exc:
            logger.warning("cleanup after an interrupted call was interrupted: %s: %s",
                           type(exc).__name__, exc)

    def stats(self) -> EngineStats:
        return self.llm_engine.stats()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()


def _check_texts(name: str, value: Any) -> None:
    """Every string in ``value`` (nested lists and dicts) must be encodable as UTF-8."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            check_text(name, v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or many, as a list."""
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)


def _per_prompt(name: str, params: Any, kind: type, n: int) -> list[Any]:
    """``params`` for each of ``n`` prompts: one object for all, or a list of ``n``."""
    if isinstance(params, kind):
        return [params] * n
    out = list(params)
    if len(out) != n:
        raise ValueError(f"{name}: got {len(out)} for {n} prompts")
    return out
