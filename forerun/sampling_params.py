"""Sampling parameters, with vLLM's names, meanings and validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from forerun.structured.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: the most top-N alternatives a request may ask for.
MAX_LOGPROBS = 20


class SamplingType(IntEnum):
    """How the sampler picks a token for one request."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    """What to generate for one prompt, and when to stop.

    Mirrors ``vllm.SamplingParams``: ``temperature == 0`` means greedy; ``top_k`` of -1
    means no top-k; ``seed`` makes a request's random stream independent of its batch.
    Invalid values raise ``ValueError`` whose message starts with the field name, so the
    server can report it as the OpenAI ``param``.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # A StructuredOutputsParams (a dict with its fields is accepted and converted).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine: the model's EOS ids that end generation unless ignore_eos.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the processor: each bad word as token sequences (with and without a
    # leading space, as the word may start a word or continue one).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            # JSON object keys are strings; vLLM accepts those too.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}."
                ) from None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        self._verify()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}.")
        for s in self.stop:  # type: ignore[union-attr]
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}.")
        for t in self.stop_token_ids:  # type: ignore[union-attr]
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")
        self._verify_logits_processing()

    def _verify_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                raise ValueError(f"logit_bias: token id {t} is negative.")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias must be in [-100, 100], got {b} for token {t}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative integers, got {t!r}.")
        for w in self.bad_words or []:
            if not isinstance(w, str) or not w.strip():
                raise ValueError(f"bad_words must contain only non-empty strings, got {w!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}.")
            if v is not None and v > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {v}.")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or t < 1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1, got {t!r}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    def update_from_model(self, eos_token_ids: list[int]) -> None:
        """Add the model's EOS ids to the stop set, unless ``ignore_eos``."""
        if not self.ignore_eos:
            self._all_stop_token_ids = set(self.stop_token_ids or []) | set(eos_token_ids)

    def clone(self) -> SamplingParams:
        p = SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, n=self.n,
            structured_outputs=self.structured_outputs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            allowed_token_ids=list(self.allowed_token_ids)
            if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words is not None else None,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )
        p._all_stop_token_ids = set(self._all_stop_token_ids)
        p._bad_words_token_ids = [list(w) for w in self._bad_words_token_ids]
        return p
