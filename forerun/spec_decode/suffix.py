"""Suffix decoding: propose the most frequent continuation of the longest matching tail,
over the request's own text and over the responses of earlier requests.

After the SuffixDecoding method (Oliaro et al., "SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications", the Arctic Inference project, and vLLM's ``suffix``
method). Where that work keeps suffix trees, this keeps, per token sequence, an index from
each pair of adjacent tokens to the places it ends: the occurrences of the text's tail are
the pair's places whose preceding tokens match furthest back (up to ``max_depth``), and
walking forward from all of them at once is walking down the suffix tree from the matched
node, with the same counts. The index costs one dict entry per token, where a tree of depth
``max_depth`` would hold up to that many nodes per token, in Python objects.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

# Occurrences of the tail examined per lookup, newest first: bounds a proposal's cost on
# text where one pair of tokens recurs thousands of times.
_MAX_CANDIDATES = 64
_SEPARATOR = -1  # between responses in the global index, so no match spans two


@dataclass(slots=True)
class TokenIndex:
    """A token sequence and, for every adjacent pair, the positions where it ends."""

    tokens: list[int] = field(default_factory=list)
    pair_ends: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    first_valid: int = 0  # positions before this were evicted

    def extend(self, token_ids: list[int]) -> None:
        toks = self.tokens
        for t in token_ids:
            toks.append(t)
            if len(toks) >= 2:
                self.pair_ends.setdefault((toks[-2], toks[-1]), []).append(len(toks) - 1)

    def match(self, context: list[int], max_depth: int, limit: int
              ) -> tuple[int, list[int]]:
        """(match length, positions just after each occurrence) of the longest tail of
        ``context`` found here ending before ``limit``; (0, []) if not even two tokens match."""
        if len(context) < 2:
            return 0, []
        ends = self.pair_ends.get((context[-2], context[-1]))
        if not ends:
            return 0, []
        toks = self.tokens
        best_len, best = 0, []
        checked = 0
        for end in reversed(ends):
            if end >= limit:
                continue
            if end < self.first_valid or checked >= _MAX_CANDIDATES:
                break
            checked += 1
            n = 2
            while (n < max_depth and n < len(context) and end - n >= self.first_valid
                   and toks[end - n] == context[-1 - n] and toks[end - n] != _SEPARATOR):
                n += 1
            if n > best_len:
                best_len, best = n, [end + 1]
            elif n == best_len:
                best.append(end + 1)
        return best_len, best

    def walk(self, starts: list[int], max_drafts: int, min_prob: float
             ) -> tuple[list[int], float]:
        """Follow the most frequent next token from every occurrence at once, while the
        path's estimated probability stays >= ``min_prob``; returns (tokens, score), the
        score being the expected number accepted (the sum of the path's probabilities)."""
        toks = self.tokens
        out: list[int] = []
        prob, score = 1.0, 0.0
        alive = starts
        while alive and len(out) < max_drafts:
            nexts = Counter(toks[p] for p in alive if p < len(toks) and toks[p] != _SEPARATOR)
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            prob *= count / len(alive)
            if prob < min_prob:
                break
            out.append(token)
            score += prob
            alive = [p + 1 for p in alive if p < len(toks) and toks[p] == token]
        return out, score


class SuffixProposer:
    """Drafts from the request's own prompt and output and from earlier responses.

    The longer the matched tail, the more drafts are allowed (``max_spec_factor`` times
    its length). Of the two sources, the proposal with the larger expected number of
    accepted tokens wins. A response joins the global index when its request finishes;
    beyond ``max_cached_requests`` the oldest are dropped.
    """

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[str, TokenIndex] = {}
        self._global = TokenIndex()
        self._responses: deque[int] = deque()  # end position of each cached response

    def add_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        index = TokenIndex()
        index.extend(token_ids)
        self._local[req_id] = index

    def remove_request(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                       finished: bool) -> None:
        self._local.pop(req_id, None)
        if finished and self.max_cached_requests > 0:
            output = token_ids[num_prompt_tokens:]
            if output:
                self._cache_response(output)

    def _cache_response(self, output: list[int]) -> None:
        g = self._global
        g.extend([*output, _SEPARATOR])
        self._responses.append(len(g.tokens))
        while len(self._responses) > self.max_cached_requests:
            g.first_valid = self._responses.popleft()
        if g.first_valid > len(g.tokens) // 2:
            self._compact()

    def _compact(self) -> None:
        old = self._global
        live = old.tokens[old.first_valid:]
        self._global = TokenIndex()
        self._global.extend(live)
        shift = old.first_valid
        self._responses = deque(end - shift for end in self._responses)

    def propose(self, req_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        local = self._local.get(req_id)
        if local is None:
            self.add_request(req_id, token_ids, len(token_ids))
            local = self._local[req_id]
        elif len(local.tokens) < len(token_ids):
            local.extend(token_ids[len(local.tokens):])
        best: list[int] = []
        best_score = 0.0
        # The request's own text, excluding the tail itself (it always matches itself).
        sources = ((local, len(token_ids) - 1), (self._global, len(self._global.tokens)))
        for index, limit in sources:
            n, starts = index.match(token_ids, self.max_depth, limit)
            if n == 0:
                continue
            cap = min(max_drafts, max(1, int(self.max_spec_factor * n)))
            drafts, score = index.walk(starts, cap, self.min_token_prob)
            if score > best_score:
                best, best_score = drafts, score
        return best
