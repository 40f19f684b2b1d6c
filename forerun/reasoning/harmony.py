"""gpt-oss's harmony format (``openai_gptoss``): the model answers in messages on channels.

An assistant turn reads, after the prompt's ``<|start|>assistant``::

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

A message's header runs from ``<|start|>`` or ``<|channel|>`` to ``<|message|>``; its body
runs to ``<|end|>``, ``<|return|>`` or ``<|call|>`` (or to the next header, or the end of
the text). Bodies on the ``analysis`` channel are reasoning; every other body (``final``,
``commentary``, or text with no header at all) is content. Headers and terminators are
markup.
"""

from __future__ import annotations

from typing import Any

from forerun.reasoning.abs_reasoning_parser import ReasoningParser, ReasoningSplit, held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
REASONING_CHANNEL = "analysis"
ANSWER_CHANNEL = "final"
# What ends a body: a terminator, or a new header the model began without one.
_BODY_STOPS = (END, RETURN, CALL, START, CHANNEL)
_TERMINATORS = (END, RETURN, CALL)


def first_of(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest of ``markers`` in ``text`` from ``pos``: (index, marker), or (-1, "")."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, pos)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


def header_field(header: str, marker: str) -> str:
    """What follows ``marker`` in a header, up to a space or a token, or "" without it."""
    i = header.find(marker)
    if i < 0:
        return ""
    name = header[i + len(marker):]
    for stop in (" ", "<|"):
        name = name.split(stop, 1)[0]
    return name


def channel_of(header: str) -> str:
    """The channel a header names (``<|channel|>NAME``), or ""."""
    return header_field(header, CHANNEL)


def keep_special_tokens(request: Any) -> Any:
    """``request`` with ``skip_special_tokens`` off: the harmony markers are special tokens
    of gpt-oss's tokenizer, and skipping them in the output text would erase the headers
    (channels, recipients) the harmony readers parse."""
    if getattr(request, "skip_special_tokens", False):
        return request.model_copy(update={"skip_special_tokens": False})
    return request


class GptOssReasoningParser(ReasoningParser):
    """The harmony reader: analysis-channel messages are reasoning, the rest content."""

    # gpt-oss calls functions on the commentary channel, never on final, where the answer
    # (and a grammar after the reasoning) starts: a forced call is constrained from the
    # first token instead, as without the parser.
    forced_calls_after_reasoning = False

    def adjust_request(self, request: Any) -> Any:
        return keep_special_tokens(request)

    def answer_start(self, text: str) -> int | None:
        # The answer is the final channel's message: it starts after the <|message|> of the
        # first header naming that channel (``<|channel|>final``, maybe ``<|constrain|>``).
        opening = CHANNEL + ANSWER_CHANNEL
        at = text.find(opening)
        while at >= 0:
            body = text.find(MESSAGE, at)
            if body < 0:
                return None  # the header is still being written
            header = text[at:body]
            if channel_of(header) == ANSWER_CHANNEL and first_of(header, 0, _TERMINATORS
                                                                   + (START,))[0] < 0:
                return body + len(MESSAGE)
            at = text.find(opening, at + 1)
        return None

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        pos, kind = 0, "content"  # text before any header: plain content
        while pos < len(text):
            at, marker = first_of(text, pos, _BODY_STOPS)
            if at < 0:
                hold = 0 if finished else held_back(text[pos:], _BODY_STOPS)
                out.add(kind, text[pos:len(text) - hold])
                return out
            out.add(kind, text[pos:at])
            if marker in _TERMINATORS:
                out.add("markup", marker)
                pos, kind = at + len(marker), "content"
                continue
            body = text.find(MESSAGE, at)
            if body < 0:
                # A header still being written says nothing yet; one the output never
                # finished (cut by max_tokens) is dropped as markup.
                if finished:
                    out.add("markup", text[at:])
                return out
            header_end = body + len(MESSAGE)
            out.add("markup", text[at:header_end])
            kind = "reasoning" if channel_of(text[at:header_end]) == REASONING_CHANNEL \
                else "content"
            pos = header_end
        return out
