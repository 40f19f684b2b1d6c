"""Pooling parameters (per request) and the pooler configuration (per engine), vLLM's names.

A pooling request is prefill-only: the engine computes its prompt, the worker pools the
final-normed hidden states of its positions into one vector, and the request ends. Like
:class:`~forerun.sampling_params.SamplingParams`, :class:`PoolingParams` crosses the
process boundary as it is (msgspec encodes its dataclass fields) and decoding re-runs its
validation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from forerun.sampling_params import SamplingParams, check_bool, check_int

# LAST: the last prompt position (what decoder embedding models such as Qwen3-Embedding
# use); MEAN: the average over every prompt position; CLS: the first position.
POOLING_TYPES = ("LAST", "MEAN", "CLS")
_MAX_DIMENSIONS = 1 << 20


def check_pooling_type(name: str, value: Any) -> str:
    """``value`` as one of :data:`POOLING_TYPES` (any case); ValueError naming ``name``."""
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{name} must be one of {', '.join(POOLING_TYPES)}, got {value!r}.")
    return value.upper()


@dataclass(slots=True)
class PoolerConfig:
    """How an engine pools (vLLM's ``--pooler-config``): the defaults of its requests."""

    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka-style truncation every request gets unless it asks for its own.
    dimensions: int | None = None

    def __post_init__(self) -> None:
        self.pooling_type = check_pooling_type("pooler_config.pooling_type", self.pooling_type)
        self.normalize = check_bool("pooler_config.normalize", self.normalize)
        if self.dimensions is not None:
            self.dimensions = check_int("pooler_config.dimensions", self.dimensions, 1,
                                        _MAX_DIMENSIONS)

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> PoolerConfig:
        """The config of ``--pooler-config`` JSON (None: the defaults); unknown keys fail."""
        value = dict(value or {})
        known = {"pooling_type", "normalize", "dimensions"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        return cls(**value)


@dataclass(slots=True)
class PoolingParams:
    """What one pooling request asks for.

    ``dimensions`` keeps the first that many values and (with ``normalize``) renormalises
    them, as matryoshka embeddings are read; ``normalize`` None takes the engine's
    :class:`PoolerConfig`; ``truncate_prompt_tokens`` keeps the last k prompt tokens.
    ``pooling_type`` is a forerun extension (vLLM fixes it per engine): None takes the
    engine's; the processor resolves both Nones before the request is queued.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            self.dimensions = check_int("dimensions", self.dimensions, 1, _MAX_DIMENSIONS)
        if self.normalize is not None:
            self.normalize = check_bool("normalize", self.normalize)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = check_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, 1, 1 << 40)
        if self.pooling_type is not None:
            self.pooling_type = check_pooling_type("pooling_type", self.pooling_type)

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would not compute."""
        return self.pooling_type not in (None, "LAST")

    def resolved(self, config: PoolerConfig, hidden_size: int) -> PoolingParams:
        """A copy with the engine's defaults filled in; ValueError if it cannot be served."""
        out = copy.copy(self)
        if out.pooling_type is None:
            out.pooling_type = config.pooling_type
        if out.normalize is None:
            out.normalize = config.normalize
        if out.dimensions is None:
            out.dimensions = config.dimensions
        if out.dimensions is not None and out.dimensions > hidden_size:
            raise ValueError(f"dimensions: the model's embeddings have {hidden_size} "
                             f"dimensions, got {out.dimensions}")
        return out

    def clone(self) -> PoolingParams:
        return copy.copy(self)


def pooling_sampling_params() -> SamplingParams:
    """The SamplingParams a pooling request carries through code written for sampling
    requests (the worker's per-row state); nothing is ever sampled with them."""
    return SamplingParams(max_tokens=1, temperature=0.0)
