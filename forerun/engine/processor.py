"""Frontend side of the inputs: validate, tokenise, and make scheduler requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forerun.pooling_params import PoolerConfig, PoolingParams
from forerun.sampling_params import (
    ALL_LOGPROBS,
    MAX_LOGPROBS,
    SamplingParams,
    check_text,
    check_token_ids,
)

PromptType = str | dict[str, Any]

# A text prompt longer than this many characters per context token is first tokenised
# only up to that length: English runs about 4 characters a token, so a head that long
# already overflows the context unless the text is unusually dense.
_HEAD_CHARS_PER_TOKEN = 8


@dataclass(slots=True)
class ProcessedPrompt:
    """A prompt as text (if it was given as text) and as token ids."""

    prompt: str | None
    prompt_token_ids: list[int]


class Processor:
    """Checks a request before any work starts, so that bad input fails alone and early."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_ids: list[int], max_logprobs: int = MAX_LOGPROBS,
                 runner: str = "generate", pooler_config: PoolerConfig | None = None,
                 hidden_size: int = 0) -> None:
        self.tokenizer = tokenizer
        # --runner pooling refuses generation; pooler_config None: this engine cannot pool.
        self.runner = runner
        self.pooler_config = pooler_config
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # EngineConfig.max_logprobs (--max-logprobs): -1 allows the whole vocabulary.
        if max_logprobs < ALL_LOGPROBS:
            raise ValueError(f"max_logprobs must be -1 or at least 0, got {max_logprobs}")
        self.max_logprobs = max_logprobs

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs one position may carry (the vocabulary when the limit is -1)."""
        return self.vocab_size if self.max_logprobs == ALL_LOGPROBS else self.max_logprobs

    def process_prompt(self, prompt: PromptType,
                       truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """Tokenise and check; ``truncate_prompt_tokens`` keeps only the last k ids."""
        k = truncate_prompt_tokens
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer")
            # The tokenizer raises TypeError on a lone surrogate; name the field instead.
            check_text("prompt", prompt)
            if k is None:
                self._reject_if_surely_too_long(prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            return self._check(ProcessedPrompt(prompt, _keep_last(list(ids), k)))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                # Ints only (no bools, no strings), each in [0, 2**63); the vocabulary
                # bound is checked next.
                ids = check_token_ids("prompt_token_ids", prompt["prompt_token_ids"])
                text = prompt.get("prompt")
                if text is not None:
                    check_text("prompt", text)
                return self._check(ProcessedPrompt(text, _keep_last(ids, k)))
            if isinstance(prompt.get("prompt"), str):
                return self.process_prompt(prompt["prompt"], k)
        raise ValueError(
            "prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )

    def _reject_if_surely_too_long(self, prompt: str) -> None:
        """Tokenise just a head of a huge prompt: when that alone fills the context, the
        rest (megabytes, seconds of CPU) is never tokenised for a request that must fail."""
        head = _HEAD_CHARS_PER_TOKEN * self.max_model_len
        if len(prompt) <= head:
            return
        n = len(self.tokenizer.encode(prompt[:head], add_special_tokens=True))
        # The cut may split one token in two; beyond that the whole is at least as long.
        if n > self.max_model_len + 1:
            raise ValueError(
                f"prompt: the prompt is longer than the model's context length of "
                f"{self.max_model_len} tokens (max_model_len): its first {head} characters "
                f"alone are {n} tokens")

    def _check(self, p: ProcessedPrompt) -> ProcessedPrompt:
        n = len(p.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: the prompt is empty")
        bad = [t for t in p.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is out of vocabulary "
                f"(0..{self.vocab_size - 1})")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: the prompt is {n} tokens long, which leaves no room to generate "
                f"within the model's context length of {self.max_model_len} tokens "
                "(max_model_len)")
        return p

    def process_params(self, params: SamplingParams) -> SamplingParams:
        if self.runner == "pooling":
            raise ValueError(
                "model: this engine runs the pooling runner (--runner pooling): it computes "
                "embeddings and scores (LLM.embed / LLM.score, /v1/embeddings, /v1/score), "
                "not generations")
        params = params.clone()
        params.update_from_model(self.eos_token_ids)
        self._check_logprobs(params)
        for t in params.stop_token_ids or []:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is out of vocabulary")
        if params.structured_outputs is not None:
            # A parse of the spec (milliseconds): a bad schema/regex/grammar fails here, alone;
            # the tokenizer-dependent compilation runs later, off the scheduler's thread.
            from forerun.structured.backend import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs)
        for name, ids in (("logit_bias", list(params.logit_bias or {})),
                          ("allowed_token_ids", params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of vocabulary (the "
                                 f"vocabulary size is {self.vocab_size}: ids "
                                 f"0..{self.vocab_size - 1})")
        if params.bad_words:
            params._bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        return params

    def process_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """The request's pooling with the engine's defaults resolved; ValueError if this
        engine cannot pool or the request asks for more than the model has."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be PoolingParams, got "
                             f"{type(params).__name__}")
        if self.pooler_config is None:
            raise ValueError("model: this engine cannot compute embeddings (pooling needs "
                             "the whole model's hidden states: no pipeline parallelism, no "
                             "simulated device)")
        return params.resolved(self.pooler_config, self.hidden_size)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """Counts above the engine's limit are refused (vLLM's rule and wording); -1 (the
        whole vocabulary) becomes the vocabulary's size, so the worker sees a count."""
        limit = self.logprobs_limit
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is None:
                continue
            if n == ALL_LOGPROBS:
                n = self.vocab_size
            if n > limit:
                asked = (f"-1 asks for the whole vocabulary ({n} logprobs)"
                         if getattr(params, name) == ALL_LOGPROBS
                         else f"requested {n} logprobs")
                raise ValueError(f"{name}: {asked}, which is greater than max allowed: "
                                 f"{limit} (--max-logprobs {self.max_logprobs})")
            setattr(params, name, n)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it tokenises alone and after a space (a word start), deduplicated."""
        if self.tokenizer is None:
            raise ValueError("bad_words: needs a tokenizer")
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    if any(t >= self.vocab_size for t in ids):
                        raise ValueError(f"bad_words: {word!r} tokenises out of vocabulary")
                    seqs.append(ids)
        return seqs


def _keep_last(ids: list[int], k: int | None) -> list[int]:
    return list(ids[-k:]) if k is not None else list(ids)


def make_processor(config: Any, info: Any, tokenizer: Any) -> Processor:
    """The processor of an engine built from ``config`` (an EngineConfig) over ``info``
    (its ModelInfo): limits, EOS ids, and whether and how it pools."""
    pooler = PoolerConfig.from_dict(config.pooler_config) if config.supports_pooling else None
    return Processor(tokenizer, info.max_model_len, info.vocab_size, info.eos_token_ids,
                     config.max_logprobs,
                     runner="pooling" if config.runner == "pooling" else "generate",
                     pooler_config=pooler, hidden_size=info.model_config.hidden_size)
