"""The interface every drafter implements, and the one that picks a drafter by method."""

from __future__ import annotations

from typing import Protocol

from forerun.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses the next tokens of a request from the tokens it has so far.

    ``token_ids`` is everything known (prompt and outputs, the newest sample last). The
    worker calls :meth:`add_request` when it (re)builds a request's row, :meth:`propose`
    after every step that sampled for it, and :meth:`remove_request` when the row goes
    (``finished`` False for a preemption, whose request comes back later).
    """

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None: ...

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int) -> list[int]: ...

    def remove_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                       finished: bool) -> None: ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The drafter for ``config.method``."""
    if config.method == "ngram":
        from forerun.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from forerun.spec_decode.suffix import SuffixProposer
    return SuffixProposer(
        max_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob)
