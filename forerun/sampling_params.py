"""Sampling parameters, with vLLM's names, meanings and validation.

:class:`SamplingParams` is also the schema of what crosses the process boundary: the
engine-core messages (``forerun/engine/core_messages.py``) carry it as it is, and msgspec
encodes and decodes it by its dataclass fields, so a new field travels with no second edit.
Decoding runs ``__post_init__`` again, so the core process sees only validated values.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from forerun.structured_params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: the most top-N alternatives a request may ask for. The
# engine's own limit (EngineConfig.max_logprobs, --max-logprobs) is checked by the
# processor, which knows the vocabulary; SamplingParams checks only the form.
MAX_LOGPROBS = 20
# A logprobs count of -1 asks for the whole vocabulary (vLLM's meaning).
ALL_LOGPROBS = -1

# Counts and token ids end up in int64 tensors and msgpack ints: one bound for them all.
INT64_MAX = 2**63 - 1
# vLLM's seed range: any value a signed or an unsigned 64-bit integer can hold. The worker
# keys a request's random stream by the seed modulo 2**64 (forerun/worker/rng.py).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Logits are divided by the temperature in float32. At 1e4, logits of magnitude 100 (far
# beyond what language models produce) shrink to 0.01, so the distribution is already
# uniform to within 2%: a larger temperature changes nothing but could reach float32's
# overflow (3.4e38), where logits / temperature stops being a number. vLLM users go up to
# the hundreds; OpenAI stops at 2.
MAX_TEMPERATURE = 1e4
# The repetition penalty divides positive logits and multiplies negative ones, in float32:
# at 1e-300 it rounds to 0 and seen tokens' logits become inf (NaN on the torch path), at
# 1e300 to inf. Bounded on both sides far outside any useful value (1.0 to 2.0; vLLM: > 0).
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4
# A sanity cap on parallel sampling: each of the n completions is a request of its own,
# so n = 2**40 would build that many before anything ran. Servers may cap lower.
MAX_N = 10_000
# JSON object keys are strings: logit_bias accepts token ids spelled in decimal.
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
# Nesting of a structured-output JSON schema given as a dict (msgpack has a depth limit).
_MAX_SCHEMA_DEPTH = 64


class SamplingType(IntEnum):
    """How the sampler picks a token for one request."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _show(value: Any) -> str:
    """The value for an error message: repr (escapes lone surrogates), kept short."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(value: Any) -> bool:
    # numbers.Integral takes numpy integers too; bool is an int in Python but not here.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``; ValueError naming ``name`` otherwise."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {_show(value)}.")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}.")
    return v


def check_logprobs_count(name: str, value: Any) -> int:
    """A logprobs count: -1 (the whole vocabulary) or a count from 0; ValueError names
    ``name``. How many a request may have is the engine's limit (the processor's check)."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {_show(value)}.")
    v = int(value)
    if not (v == ALL_LOGPROBS or 0 <= v <= INT64_MAX):
        raise ValueError(f"{name} must be -1 (the whole vocabulary) or a count from 0, "
                         f"got {v}.")
    return v


def check_real(name: str, value: Any) -> float:
    """``value`` as a finite float; ValueError naming ``name`` otherwise."""
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {_show(value)}.")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v}.")
    return v


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {_show(value)}.")
    return value


def check_text(name: str, value: Any) -> str:
    """``value`` as a str that UTF-8 can encode (a lone surrogate cannot)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_show(value)}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} is not valid Unicode text (a lone surrogate at index {e.start}).") from None
    return value


def check_token_ids(name: str, value: Any) -> list[int]:
    """A list (or tuple) of token ids, each an int in [0, 2**63); not a string."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {_show(value)}.")
    out = []
    for t in value:
        if not _is_int(t) or not 0 <= int(t) <= INT64_MAX:
            raise ValueError(
                f"{name} must contain only token ids (integers in [0, 2**63)), got {_show(t)}.")
        out.append(int(t))
    return out


def _check_json_value(name: str, value: Any) -> None:
    """A JSON schema given as a dict holds only what JSON (and msgpack) can carry."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > _MAX_SCHEMA_DEPTH:
            raise ValueError(f"{name} is nested deeper than {_MAX_SCHEMA_DEPTH} levels.")
        if isinstance(v, dict):
            for k, item in v.items():
                check_text(f"{name} (a key)", k)
                stack.append((item, depth + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((item, depth + 1) for item in v)
        elif isinstance(v, str):
            check_text(name, v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"{name} must not contain NaN or infinity.")
        elif isinstance(v, int) and not isinstance(v, bool):
            if not SEED_MIN <= v <= SEED_MAX:
                raise ValueError(f"{name} holds an integer out of the 64-bit range.")
        elif v is not None and not isinstance(v, bool):
            raise ValueError(f"{name} must hold only JSON values, got {type(v).__name__}.")


def _check_structured(value: Any) -> StructuredOutputsParams:
    if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
        raise ValueError("structured_outputs: field names must be strings.")
    so = StructuredOutputsParams.from_any(value)
    for name in ("regex", "grammar"):
        if getattr(so, name) is not None:
            check_text(f"structured_outputs.{name}", getattr(so, name))
    for c in so.choice or []:
        check_text("structured_outputs.choice", c)
    if isinstance(so.json, str):
        check_text("structured_outputs.json", so.json)
    elif so.json is not None:
        _check_json_value("structured_outputs.json", so.json)
    if so.json_object is not None:
        check_bool("structured_outputs.json_object", so.json_object)
    return so


@dataclass(slots=True)
class SamplingParams:
    """What to generate for one prompt, and when to stop.

    Mirrors ``vllm.SamplingParams``: ``temperature == 0`` means greedy; ``top_k`` of -1
    means no top-k; ``seed`` makes a request's random stream independent of its batch.
    Every field is checked for type, range and finiteness on construction (and again when
    the core process decodes it); an invalid value raises ``ValueError`` whose message
    starts with the field name, so the server can report it as the OpenAI ``param``.
    A bool is not accepted where a number is expected, nor a string where a list is.
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
    # vLLM's extension point; forerun reads "kv_transfer_params" (docs/kv_connector.md).
    extra_args: dict[str, Any] | None = None
    # Filled in by the engine: the model's EOS ids that end generation unless ignore_eos.
    # Private, but a field: it must cross the process boundary with the rest.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the processor: each bad word as token sequences (with and without a
    # leading space, as the word may start a word or continue one).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._verify()
        # A union, not an assignment: a decoded copy arrives with the EOS ids already in.
        self._all_stop_token_ids = set(self.stop_token_ids or []) | {
            int(t) for t in self._all_stop_token_ids}
        self._bad_words_token_ids = [list(seq) for seq in self._bad_words_token_ids]

    def _verify(self) -> None:
        """Check and normalise every field (ints to int, numbers to float, lists to list)."""
        if self.max_tokens is not None:
            self.max_tokens = check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        self.temperature = check_real("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.")
        self.top_p = check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        # Larger than the vocabulary is allowed and means no top-k (the sampler clamps).
        self.top_k = check_int("top_k", self.top_k, -1, INT64_MAX)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disable), or at least 1, got 0.")
        self.n = check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        self.stop = self._stop_strings()
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids or [])
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            setattr(self, name, check_bool(name, getattr(self, name)))
        self.min_tokens = check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = check_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, 1, INT64_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, check_logprobs_count(name, getattr(self, name)))
        if self.structured_outputs is not None:
            self.structured_outputs = _check_structured(self.structured_outputs)
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict) or not all(
                    isinstance(k, str) for k in self.extra_args):
                raise ValueError("extra_args must be a dict with string keys")
            params = self.extra_args.get("kv_transfer_params")
            if params is not None and not isinstance(params, dict):
                raise ValueError("kv_transfer_params must be an object")
        self._verify_logits_processing()

    def _stop_strings(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {_show(stop)}.")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {_show(s)}.")
            check_text("stop", s)
        return list(stop)

    def _verify_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = check_real(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}.")
            setattr(self, name, v)
        rp = check_real("repetition_penalty", self.repetition_penalty)
        if not rp > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {rp}.")
        if not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}], got {rp}.")
        self.repetition_penalty = rp
        self.min_p = check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.logit_bias is not None:
            self.logit_bias = self._checked_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = check_token_ids("allowed_token_ids",
                                                     self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(
                    f"bad_words must be a list of strings, got {_show(self.bad_words)}.")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(
                        f"bad_words must contain only non-empty strings, got {_show(w)}.")
                check_text("bad_words", w)
            self.bad_words = list(self.bad_words)

    @staticmethod
    def _checked_logit_bias(bias: Any) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {_show(bias)}.")
        out: dict[int, float] = {}
        for k, b in bias.items():
            # JSON object keys are strings; vLLM accepts those too.
            if isinstance(k, str) and _DECIMAL.fullmatch(k):
                t = int(k)
            elif _is_int(k):
                t = int(k)
            else:
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got the key {_show(k)}.")
            if not 0 <= t <= INT64_MAX:
                raise ValueError(f"logit_bias: token id {t} is out of range [0, 2**63).")
            if not _is_real(b) or not math.isfinite(float(b)):
                raise ValueError(
                    f"logit_bias must map token ids to finite numbers, got {_show(b)} "
                    f"for token {t}.")
            v = float(b)
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias must be in [-100, 100], got {v} for token {t}.")
            out[t] = v
        return out

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
    def supports_spec_decode(self) -> bool:
        """Whether a request may be given drafts; the others decode one token per step.

        Verification samples every draft position in one step, each with the rules as they
        apply there: ``min_tokens``, penalties (counts include the drafts before the
        position) and bad words (their history too) are exact per position. A grammar would
        have to advance through each draft before masking the next; grammar requests take
        K = 0.
        """
        return self.structured_outputs is None

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        return self._bad_words_token_ids

    def update_from_model(self, eos_token_ids: list[int]) -> None:
        """Add the model's EOS ids to the stop set, unless ``ignore_eos``."""
        if not self.ignore_eos:
            self._all_stop_token_ids = set(self.stop_token_ids or []) | set(eos_token_ids)

    def clone(self) -> SamplingParams:
        """An independent copy of every field, private ones included.

        A deep copy rather than a field-by-field constructor call, so that a new field
        cannot be forgotten here.
        """
        return copy.deepcopy(self)


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's beam search parameters (``LLM.beam_search`` and the server's ``n``)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.beam_width = check_int("beam_width", self.beam_width, 1, 1 << 20)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, 1 << 40)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output",
                                                     self.include_stop_str_in_output)
        self.temperature = check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature}.")
        self.length_penalty = check_real("length_penalty", self.length_penalty)

    def step_params(self) -> SamplingParams:
        """One round's request: one token, with the logprobs the candidates come from."""
        # ignore_eos: an EOS is a candidate like any token; the search decides.
        return SamplingParams(max_tokens=1, temperature=self.temperature,
                              logprobs=2 * self.beam_width, ignore_eos=True)
