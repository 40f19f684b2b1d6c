"""``speculative_config``: vLLM's dict, checked once into a dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from forerun.sampling_params import check_int, check_real

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 32


@dataclass(slots=True)
class SpeculativeConfig:
    """How many tokens to draft per step, and how (vLLM's names for every field).

    ``ngram`` (prompt lookup): the longest suffix of the text so far, between
    ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, that occurred earlier in the
    prompt or output proposes the tokens that followed it. ``suffix`` (suffix decoding):
    counts of continuations over the request's own text and over earlier responses,
    proposing the most frequent path while its estimated probability stays at or above
    ``suffix_decoding_min_token_prob``.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # No drafts while more requests than this run (vLLM's name): where a step's cost grows
    # with its tokens (a CPU at a few requests), verifying drafts costs more than it saves.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: must be one of {', '.join(METHODS)}"
                             f"; got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1,
                   MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 1 << 16)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min,
                   1 << 16)
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth,
                   1, 1024)
        _check_int("suffix_decoding_max_cached_requests",
                   self.suffix_decoding_max_cached_requests, 0, 1 << 30)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 30)
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            if check_real(f"speculative_config.{name}", getattr(self, name)) < 0:
                raise ValueError(f"speculative_config.{name} must be >= 0")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """Parse vLLM's dict; None (or ``num_speculative_tokens`` 0) means no drafting."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config: must be a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: 'method' and 'num_speculative_tokens' are "
                             "required")
        if value["num_speculative_tokens"] == 0:
            return None
        args = dict(value)
        # vLLM accepts either bound alone; the other follows it.
        if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
            args["prompt_lookup_min"] = min(2, args["prompt_lookup_max"])
        if "prompt_lookup_min" in args and "prompt_lookup_max" not in args:
            args["prompt_lookup_max"] = max(5, args["prompt_lookup_min"])
        return cls(**args)


def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    check_int(f"speculative_config.{name}", v, lo, hi)
