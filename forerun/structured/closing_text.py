"""The budget-aware ending of ``choice`` and ``regex`` outputs: end inside the language.

A choice or a pattern cut by ``max_tokens`` ends mid-word (``'yello'``). Near the end of
its budget, each step, the request's *completion bound* is computed: a token sequence that
completes an accepted string from the grammar's state (for a choice, the fewest tokens
that spell the rest of any choice still possible; for a regex, a short completion found
by a greedy walk over characters on a fork of the matcher, spelled in the fewest tokens).
When the tokens left come within reach of that bound, the grammar's mask is narrowed to
the tokens after which some completion still fits in the tokens left after them; each
kept token carries the completion that proved it, so the bound never grows from one step
to the next and the answer always completes: the model still ends it (``stop``, where its
stop token is allowed) or ``max_tokens`` does (``length``), now on a whole answer. If even
the bound does not fit, nothing is narrowed and ``max_tokens`` cuts the output as before.

Narrowing removes only tokens that could not end inside the language in time, so a run
whose answer fits is unchanged token for token. For a choice every candidate is checked
(there are few); for a regex, whose mask can allow thousands of tokens, they are checked
one by one only when few, and otherwise the kept tokens are those that start the bound's
own text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Up to this many candidates each gets a fork of the matcher (a fork costs tens of
# microseconds); beyond it they are tried on the matcher itself and rolled back.
CHECK_LIMIT = 256
# Longest completion string the pattern walk tries before giving up.
MAX_WALK_CHARS = 256
# Characters the walk tries, in order: letters and digits first (what patterns most
# often repeat), then punctuation that often ends them, then the rest of printable ASCII.
_ALPHABET = "".join(dict.fromkeys(
    "abcdefghijklmnopqrstuvwxyz0123456789.ABCDEFGHIJKLMNOPQRSTUVWXYZ -_,;:!?/@#"
    + "".join(chr(c) for c in range(0x20, 0x7F)) + "\n\t"))


@dataclass(slots=True)
class TextClosingState:
    """One choice or regex request's ending: the bytes so far, the proven completions."""

    choices: list[bytes] | None          # the choice strings (None for a regex)
    written: bytearray = field(default_factory=bytearray)
    # Kept token -> the completion (token ids) that proved it, for the mask just built.
    carried: dict[int, list[int]] = field(default_factory=dict)
    proven: list[int] | None = None      # the completion the last accepted token carried
    plan: list[int] | None = None        # the latest completion bound (token ids)
    planned_at: int = -1                 # num_output_tokens when it was computed
    started_at: int | None = None        # num_output_tokens when narrowing began
    longest: int | None = None           # the most tokens one choice takes

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def accept(self, token_id: int, data: bytes) -> None:
        self.written += data
        self.proven = self.carried.get(token_id)
        self.carried = {}


def segment(id_of: dict[bytes, int], max_len: int, data: bytes) -> list[int] | None:
    """The fewest tokens whose bytes spell ``data`` exactly (None if the vocabulary cannot)."""
    n = len(data)
    best: list[tuple[int, int] | None] = [None] * (n + 1)  # (count, previous cut)
    best[0] = (0, -1)
    for i in range(n):
        if best[i] is None:
            continue
        count = best[i][0] + 1
        for j in range(i + 1, min(n, i + max_len) + 1):
            if data[i:j] in id_of and (best[j] is None or best[j][0] > count):
                best[j] = (count, i)
    if best[n] is None:
        return None
    ids: list[int] = []
    j = n
    while j > 0:
        i = best[j][1]
        ids.append(id_of[data[i:j]])
        j = i
    return ids[::-1]


def walk_pattern(matcher: Any, prefer: str = "",
                 limit: int = MAX_WALK_CHARS) -> tuple[str | None, int]:
    """A short string that completes the pattern from ``matcher``'s state, and how many
    steps it advanced ``matcher`` (roll them back, or pass a fork). Greedy: the grammar's
    forced text; else a character that completes at once; else the first accepted one,
    trying ``prefer``'s characters first, then :data:`_ALPHABET`'s."""
    alphabet = "".join(dict.fromkeys(prefer + _ALPHABET)) if prefer else _ALPHABET
    out: list[str] = []
    size = steps = 0
    while size <= limit:
        if matcher.is_completed():
            return "".join(out), steps
        forced = matcher.find_jump_forward_string()
        if forced:
            if not matcher.accept_string(forced):
                return None, steps
            steps += 1
            out.append(forced)
            size += len(forced)
            continue
        first = None
        for ch in alphabet:
            if not matcher.accept_string(ch):
                continue
            if matcher.is_completed():
                out.append(ch)
                return "".join(out), steps + 1
            matcher.rollback(1)
            if first is None:
                first = ch
        if first is None:
            return None, steps
        matcher.accept_string(first)
        steps += 1
        out.append(first)
        size += 1
    return None, steps


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a packed mask row (xgrammar's layout) allows."""
    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def mask_of(ids: list[int], words: int) -> torch.Tensor:
    """A packed mask row allowing exactly ``ids``."""
    keep = torch.zeros(words * 32, dtype=torch.bool)
    if ids:
        keep[torch.tensor(ids)] = True
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int64)
    packed = (keep.view(words, 32).to(torch.int64) * weights).sum(dim=1)
    return packed.to(torch.int32)


class TextClosingPlanner:
    """Completion bounds and narrowed masks for choice and regex requests (one tokenizer)."""

    def __init__(self, token_bytes: list[bytes], id_of: dict[bytes, int],
                 stop_ids: set[int]) -> None:
        self.token_bytes = token_bytes
        self.id_of = id_of
        self.stop_ids = stop_ids
        self.max_len = max((len(b) for b in id_of), default=1)

    def spell(self, data: bytes) -> list[int] | None:
        return segment(self.id_of, self.max_len, data)

    def longest(self, st: TextClosingState) -> int:
        """The most tokens any one choice takes (a choice's narrowing starts within it)."""
        if st.longest is None:
            st.longest = max((len(self.spell(c) or c) for c in st.choices or []), default=0)
        return st.longest

    def bound(self, st: TextClosingState, matcher: Any) -> list[int] | None:
        """A completion from the current state (token ids), the shortest one known."""
        fresh = self._complete(st, bytes(st.written), matcher.fork())
        if st.proven is not None and (fresh is None or len(st.proven) < len(fresh)):
            return st.proven
        return fresh

    def _complete(self, st: TextClosingState, written: bytes, fork: Any) -> list[int] | None:
        if st.choices is not None:
            best = None
            for c in st.choices:
                if c.startswith(written):
                    ids = self.spell(c[len(written):])
                    if ids is not None and (best is None or len(ids) < len(best)):
                        best = ids
            return best
        text, _ = walk_pattern(fork)
        return None if text is None else self.spell(text.encode())

    def narrow(self, st: TextClosingState, matcher: Any, row: torch.Tensor,
               plan: list[int], left: int, vocab_size: int) -> None:
        """Keep in ``row`` the tokens after which a completion fits in ``left - 1`` tokens;
        each kept token's completion is carried in ``st`` for the next step."""
        written = bytes(st.written)
        room = left - 1
        carried: dict[int, list[int]] = {plan[0]: plan[1:]} if plan else {}
        candidates = allowed_ids(row, vocab_size)
        # A stop token is allowed only where the answer is complete: it always fits.
        carried.update({t: [] for t in candidates if t in self.stop_ids})
        if len(candidates) > CHECK_LIMIT and st.choices is None:
            self._check_on_matcher(matcher, candidates, plan, room, carried)
        else:
            for t in candidates:
                if t in carried:
                    continue
                data = written + self.token_bytes[t]
                if st.choices is not None:
                    rest = self._complete(st, data, None)
                else:
                    fork = matcher.fork()
                    rest = self._complete(st, data, fork) if fork.accept_token(t) else None
                if rest is not None and len(rest) <= room:
                    carried[t] = rest
        st.carried = carried
        row.copy_(mask_of(sorted(carried), row.shape[0]))

    def _check_on_matcher(self, matcher: Any, candidates: list[int], plan: list[int],
                          room: int, carried: dict[int, list[int]]) -> None:
        """The regex candidates tried on the request's own matcher, each rolled back at
        once: accepting a token and rolling it back costs a few microseconds where a fork
        costs tens, and a mask can allow thousands. The walk tries the bound's characters
        first and gives up past the bound's length plus a little (a dropped token is
        always safe: the bound's first token stays)."""
        text = b"".join(self.token_bytes[t] for t in plan).decode("utf-8", "replace")
        limit = len(text) + 16
        for t in candidates:
            if t in carried or not matcher.accept_token(t):
                continue
            steps = 1
            try:
                if matcher.is_completed():
                    rest: list[int] | None = []
                elif room == 0:
                    rest = None
                else:
                    found, n = walk_pattern(matcher, text, limit)
                    steps += n
                    rest = None if found is None else self.spell(found.encode())
            finally:
                matcher.rollback(steps)
            if rest is not None and len(rest) <= room:
                carried[t] = rest
