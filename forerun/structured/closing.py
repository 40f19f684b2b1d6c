"""The budget-aware ending of JSON outputs: close the open JSON before ``max_tokens`` cuts it.

A small model can loop inside a string or an array that the schema leaves unbounded until
``max_tokens`` cuts the JSON. Each step, for a JSON request near the end of its budget, a
*completion plan* is computed from the request's grammar state: a short string that the
grammar accepts and that completes the JSON (close the string, add the required keys that
are missing with minimal values, close the arrays and objects), tokenised. When the tokens
left (``max_tokens`` minus the tokens delivered; the only token in flight when a grammar
mask is built is the one it masks) come within ``CLOSING_MARGIN`` of the plan's length,
the request enters its *closing phase*: while at least two tokens of slack remain the
model may choose any token that starts the plan's text (``"``, ``"]``, ``"]}`` ...), and
the plan is recomputed after it; otherwise only the plan's next token is allowed, until
the JSON is complete. Nothing new is opened in the closing phase (no new array item, key
or string content): those are what the budget has no room for. Before that step the masks
are exactly the grammar's, so every token before the closing phase is the one a
budget-unaware run gives.

The plan is found by a greedy walk over characters on a fork of the request's matcher:
the grammar's forced text first (``find_jump_forward_string``), otherwise the first
character the grammar accepts from a list ordered by what closes the innermost open
structure soonest (a tiny JSON lexer says which structure that is). It is short, not
provably shortest; a walk that does not complete the JSON within ``MAX_PLAN_CHARS`` gives
no plan, and the request is then left unrestricted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

# How many tokens of slack the closing phase keeps above the plan's length: one free
# token can open a structure (a new array item, a nested object with required keys) whose
# completion is this much longer than the plan before it.
CLOSING_MARGIN = 8
# Longest completion string the walk tries before giving up.
MAX_PLAN_CHARS = 512
# In a string the grammar will not close yet, the walk looks this many characters ahead
# (over this many of the preferred characters) for the shortest way to the closing quote.
LOOKAHEAD = 2
LOOKAHEAD_ALPHABET = 16
# Far from the end, the plan is recomputed every this many tokens (its length changes
# slowly); near the end, every step.
PLAN_STRIDE = 8

_SCALAR = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-.")
_WS = frozenset(b" \t\r\n")

# Lexer states outside strings.
VALUE, VALUE_OR_CLOSE, KEY_OR_CLOSE, KEY, COLON, AFTER, SCALAR = range(7)

_DIGITS = "0123456789"
_LOWER = "abcdefghijklmnopqrstuvwxyz"
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F))
# Inside a string: the quote first, then the characters that formats and patterns most
# often need next.
_IN_STRING = ('"0a-.:@TZ+/_' + _DIGITS[1:] + _LOWER[1:] + _UPPER)
_VALUE_START = '0"[{nft-' + _DIGITS[1:]


def _dedup(chars: str) -> str:
    return "".join(dict.fromkeys(chars + _PRINTABLE))


_PREFS = {
    VALUE: _dedup(_VALUE_START),
    VALUE_OR_CLOSE: _dedup("]" + _VALUE_START),
    KEY_OR_CLOSE: _dedup('}"'),
    KEY: _dedup('"'),
    COLON: _dedup(": "),
    AFTER: None,   # the innermost closer, then ","
    SCALAR: None,  # the innermost closer, then ",", then digits
}
_IN_STRING_PREFS = _dedup(_IN_STRING)


@dataclass(slots=True)
class JsonLexer:
    """Where in a JSON text its bytes so far leave off: open containers, string or not."""

    stack: list[int] = field(default_factory=list)  # b"{" or b"["
    state: int = VALUE
    in_string: bool = False
    is_key: bool = False
    escape: bool = False
    last: int = 0  # the last byte fed

    def copy(self) -> JsonLexer:
        return JsonLexer(list(self.stack), self.state, self.in_string, self.is_key, self.escape,
                         self.last)

    @property
    def in_value_string(self) -> bool:
        return self.in_string and not self.is_key

    def feed(self, data: bytes) -> None:
        for c in data:
            self._feed_byte(c)
        if data:
            self.last = data[-1]

    def _feed_byte(self, c: int) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == 0x5C:  # backslash
                self.escape = True
            elif c == 0x22:  # quote
                self.in_string = False
                self.state = COLON if self.is_key else AFTER
            return
        state = self.state
        if state == SCALAR:
            if c in _SCALAR:
                return
            self.state = state = AFTER
        if c in _WS:
            return
        if state in (VALUE, VALUE_OR_CLOSE):
            if c == 0x22:
                self.in_string, self.is_key = True, False
            elif c == 0x7B:  # {
                self.stack.append(0x7B)
                self.state = KEY_OR_CLOSE
            elif c == 0x5B:  # [
                self.stack.append(0x5B)
                self.state = VALUE_OR_CLOSE
            elif c == 0x5D and state == VALUE_OR_CLOSE:
                self._close()
            else:
                self.state = SCALAR
        elif state in (KEY_OR_CLOSE, KEY):
            if c == 0x22:
                self.in_string, self.is_key = True, True
            elif c == 0x7D and state == KEY_OR_CLOSE:
                self._close()
        elif state == COLON:
            if c == 0x3A:
                self.state = VALUE
        elif state == AFTER:
            if c == 0x2C:  # ,
                self.state = KEY if self.stack and self.stack[-1] == 0x7B else VALUE
            elif c in (0x7D, 0x5D):
                self._close()

    def _close(self) -> None:
        if self.stack:
            self.stack.pop()
        self.state = AFTER

    def preferences(self) -> str:
        """Characters to try next, the one that closes soonest first."""
        if self.in_string:
            last = chr(self.last) if 0x20 <= self.last < 0x7F else ""
            # The character just written goes last, so that a format or pattern walks on
            # instead of repeating one character (and writes no run of zeros that stricter
            # checkers refuse, such as an IPv4 part "00").
            return _IN_STRING_PREFS.replace(last, "") + last if last else _IN_STRING_PREFS
        prefs = _PREFS[self.state]
        if prefs is not None:
            return prefs
        closer = "}" if self.stack and self.stack[-1] == 0x7B else "]"
        if not self.stack:
            closer = ""
        if self.state == SCALAR:
            return _dedup(closer + "," + _DIGITS + ".eE")
        return _dedup(closer + ",")


def walk_completion(matcher: Any, lexer: JsonLexer) -> str | None:
    """A string that completes the JSON from ``matcher``'s state, or None if none found.

    ``matcher`` is consumed (pass a fork). Greedy: the grammar's forced text, else the
    first accepted character in the lexer's order of preference.
    """
    lexer = lexer.copy()
    out: list[str] = []
    size = 0
    while size <= MAX_PLAN_CHARS:
        if matcher.is_completed():
            return "".join(out)
        forced = matcher.find_jump_forward_string()
        if forced:
            if not matcher.accept_string(forced):
                return None
            chunk = forced
        else:
            prefs = lexer.preferences()
            chunk = _toward_quote(matcher, prefs) if lexer.in_string else None
            if chunk is None:
                for ch in prefs:
                    if matcher.accept_string(ch):
                        chunk = ch
                        break
                else:
                    return None
        lexer.feed(chunk.encode())
        out.append(chunk)
        size += len(chunk)
    return None


def _toward_quote(matcher: Any, prefs: str) -> str | None:
    """In a string the grammar will not close yet (a format, a pattern, a minLength): the
    shortest run of at most ``LOOKAHEAD`` of the first preferred characters after which it
    will, accepted on ``matcher``; None (nothing accepted) if there is none."""
    if matcher.accept_string('"'):
        return '"'
    alphabet = prefs[1:LOOKAHEAD_ALPHABET]
    frontier = [""]
    for _ in range(LOOKAHEAD):
        grown = []
        for run in frontier:
            for ch in alphabet:
                cand = run + ch
                if not matcher.accept_string(cand):
                    continue
                closes = matcher.accept_string('"')
                matcher.rollback(2 if closes else 1)
                if closes:
                    matcher.accept_string(cand)
                    return cand
                grown.append(cand)
        frontier = grown[:LOOKAHEAD_ALPHABET]
    return None


@dataclass(slots=True)
class ClosingState:
    """One request's budget-aware ending: its lexer, its latest plan, its phase."""

    lexer: JsonLexer = field(default_factory=JsonLexer)
    plan: list[int] | None = None        # the latest completion plan (token ids)
    planned_at: int = -1                 # num_output_tokens when it was computed
    started_at: int | None = None        # num_output_tokens when the closing phase began
    forced: deque[int] = field(default_factory=deque)  # plan being followed to the end

    @property
    def active(self) -> bool:
        return self.started_at is not None


class ClosingPlanner:
    """Plans completions for one tokenizer: tokenises the walk, keeps the vocabulary masks."""

    def __init__(self, tokenizer: Any, token_bytes: list[bytes], vocab_size: int,
                 special_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.vocab_size = vocab_size
        # Bytes -> the first non-special token spelling them exactly.
        self.id_of: dict[bytes, int] = {}
        for tid, b in enumerate(token_bytes[:vocab_size]):
            if b and tid not in special_ids:
                self.id_of.setdefault(b, tid)

    def closing_tokens(self, plan: list[int]) -> torch.Tensor:
        """The packed mask (xgrammar's layout) of every token that starts the plan's text
        (``"``, ``"]``, ``"],`` ...): ways to close that the plan's first token may not be."""
        words = (self.vocab_size + 31) // 32
        keep = torch.zeros(words, dtype=torch.int32)
        text = b"".join(self.token_bytes[t] for t in plan)
        ids = {plan[0]}
        for end in range(1, len(text) + 1):
            tid = self.id_of.get(text[:end])
            if tid is not None:
                ids.add(tid)
        for tid in ids:
            w, b = divmod(tid, 32)
            keep[w] |= (1 << b) - (1 << 32 if b == 31 else 0)
        return keep

    def plan(self, matcher: Any, lexer: JsonLexer) -> list[int] | None:
        """Token ids that complete the JSON from ``matcher``'s state (checked on a fork)."""
        text = walk_completion(matcher.fork(), lexer)
        if text is None:
            return None
        if text == "":
            return []
        for ids in (self._tokenizer.encode(text, add_special_tokens=False),
                    [t for ch in text for t in self._tokenizer.encode(
                        ch, add_special_tokens=False)]):
            check = matcher.fork()
            if all(check.accept_token(t) for t in ids) and check.is_completed():
                return list(ids)
        return None


def only_token(row: torch.Tensor, token_id: int) -> None:
    """Leave just ``token_id`` allowed in the packed mask ``row`` (if it was allowed)."""
    w, b = divmod(token_id, 32)
    allowed = (int(row[w]) >> b) & 1
    row.zero_()
    if allowed:
        row[w] = (1 << b) - (1 << 32 if b == 31 else 0)


def is_allowed(row: torch.Tensor, token_id: int) -> bool:
    w, b = divmod(token_id, 32)
    return bool((int(row[w]) >> b) & 1)
