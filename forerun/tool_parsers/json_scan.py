"""Where the members of a possibly unfinished JSON object lie in a text (for streaming)."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


@dataclass(slots=True)
class Member:
    """One ``"key": value`` of an object: the value's span in the text (end None: unfinished)."""

    key: str
    value_start: int
    value_end: int | None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string opening at ``text[i] == '"'``; None if unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; None if the text stops inside it.

    Only nesting and strings are tracked, not validity: the caller parses the finished span.
    A number or literal running to the end of the text counts as unfinished, as more digits
    may follow.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",]}":
        j += 1
    return j if j < len(text) else None


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """Members of the object opening at ``text[i] == '{'`` as far as the text goes, and the
    object's end (exclusive), None while unfinished. A key is listed once its value starts.
    """
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] != '"':
            return members, None  # not JSON; the finished text will not parse either
        key_end = _string_end(text, j)
        if key_end is None:
            break
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            break
        j = skip_ws(text, key_end)
        if j >= len(text) or text[j] != ":":
            break
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j)
        members.append(Member(key, j, end))
        if end is None:
            break
        j = skip_ws(text, end)
    return members, None
