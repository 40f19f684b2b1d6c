"""What the worker remembers about one request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the worker remembers about a request between steps.

    ``token_ids`` holds only the ids the scheduler sent (the prompt, or every known id when
    a preempted request resumes). Output ids are never sent back: the position after the
    last known id is fed from ``ModelRunner.last_sampled`` on the device.
    """

    req_id: str
    token_ids: list[int]
    block_ids: tuple[list[int], ...]  # one block table per KV cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    rng_key: int  # the key of this request's uniforms (forerun.worker.rng)
    slot: int  # stable row of this request in the runner's device tensors
    last_sampled_pos: int = -1  # position of the token held in last_sampled[slot]
    num_prompt_tokens: int = 0
    # Outputs that exist, known or not: those sent on resume plus every sample taken here
    # (a count the worker knows without reading the ids back from the device).
    num_output_tokens: int = 0
    want_prompt_logprobs: bool = False
    # Multi-token bad words; their prefixes are matched against the device history.
    bad_word_seqs: list[list[int]] = field(default_factory=list)
    # Speculative decoding: the drafter's guesses for the positions after the last sample.
    # A runner with a drafter also appends every sample to ``token_ids`` (the drafter reads
    # the text on the host), so no position is fed from ``last_sampled``.
    spec_token_ids: list[int] = field(default_factory=list)
    # Whether the drafter proposes for this request (see SamplingParams.supports_spec_decode).
    spec_enabled: bool = False
    # How many drafts to propose next (adaptive: up after a fully accepted run, down after
    # a rejection); -1 until the request's first verification (then the configured K).
    num_draft_limit: int = -1
    # A pooling request: its hidden states are pooled (worker/pooler.py), never sampled.
    pooling_params: PoolingParams | None = None
