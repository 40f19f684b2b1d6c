"""Prompt lookup: the tokens that followed the last earlier occurrence of the text's tail."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Matches the longest tail of ``n`` tokens (``max_n`` down to ``min_n``) that occurred
    earlier in the prompt or output, and proposes what followed its latest occurrence.

    The latest occurrence, because in the texts this wins on (copying, editing, quoting an
    earlier answer) the nearest repeat is the one being continued. Stateless: each call
    scans the whole history, a few vectorised comparisons per ``n``.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        pass

    def remove_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                       finished: bool) -> None:
        pass

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        return ngram_lookup(token_ids, self.min_n, self.max_n, max_drafts)


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens after the latest earlier match of the longest matching tail."""
    total = len(token_ids)
    if k <= 0 or total < min_n + 1:
        return []
    h = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = h[total - n:]
        # Windows that start early enough to be followed by at least one token.
        windows = sliding_window_view(h[: total - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start: start + k]
    return []
