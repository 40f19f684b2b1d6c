"""gpt-oss's tool calls in the harmony format: ``--tool-call-parser openai`` (vLLM's name).

In harmony a function call is a message addressed to the function, on the commentary
channel; the recipient may stand before the channel or after it, and a content type
(``<|constrain|>json`` or a bare ``json``) may follow::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>

Each message addressed to ``functions.NAME`` is one call of ``NAME``, its body the call's
arguments as the model wrote them (not checked: a body that is not JSON is still passed on,
as vLLM does). The body ends at ``<|call|>``, ``<|end|>``, ``<|return|>``, the next header or
the end of the text: gpt-oss stops on ``<|call|>``, which the output text may leave out.

The content is the body of every other message except the reasoning: ``final`` and
``commentary`` messages without a recipient (tool-call preambles) and text with no header
at all. ``analysis`` messages are left to ``--reasoning-parser openai_gptoss``, and messages
to a recipient other than ``functions.*`` (gpt-oss's built-in browser and python tools,
which forerun does not run) are dropped, as in vLLM. This parser reads the model's whole
text, headers included (:attr:`ToolParser.reads_whole_output`): the reasoning parser's
content has the headers, and with them the recipients, already taken out.
"""

from __future__ import annotations

from typing import Any, Literal

from forerun.reasoning.abs_reasoning_parser import held_back
from forerun.reasoning.harmony import (
    CALL,
    CHANNEL,
    END,
    MESSAGE,
    REASONING_CHANNEL,
    RETURN,
    START,
    channel_of,
    first_of,
    header_field,
    keep_special_tokens,
)
from forerun.tool_parsers.abstract_tool_parser import (
    FunctionCallDraft,
    ParsedToolOutput,
    ToolParser,
)

FUNCTIONS = "functions."
RECIPIENT = "to="
_TERMINATORS = (END, RETURN, CALL)
# What ends a body: a terminator, or a new header the model began without one.
_BODY_STOPS = (END, RETURN, CALL, START, CHANNEL)

_Kind = Literal["content", "call", "drop"]


def recipient_of(header: str) -> str:
    """The recipient a header names (``to=NAME``), or ""."""
    return header_field(header, RECIPIENT)


def _opens_with_recipient(text: str) -> bool | None:
    """Whether the output starts inside the header the prompt's ``<|start|>assistant``
    opened (`` to=functions.x<|channel|>...``); None while it cannot tell yet."""
    head = text.lstrip(" ")
    if head.startswith(RECIPIENT):
        return True
    if RECIPIENT.startswith(head):  # "", "t", "to" (after any spaces): wait
        return None
    return False


class OpenAIToolParser(ToolParser):
    """``--tool-call-parser openai``: harmony's function calls (gpt-oss)."""

    reads_whole_output = True

    def adjust_request(self, request: Any) -> Any:
        return keep_special_tokens(request)

    def parse(self, text: str, finished: bool) -> ParsedToolOutput:
        content: list[str] = []
        calls: list[FunctionCallDraft] = []
        kind: _Kind = "content"  # text before any header: plain content

        def add(piece: str) -> None:
            if kind == "content":
                content.append(piece)
            elif kind == "call":
                calls[-1].arguments += piece

        pos = 0
        opens = _opens_with_recipient(text)
        if opens is None and not finished:
            return ParsedToolOutput("")
        if opens:
            # The header begun in the prompt runs to its <|message|>.
            at = text.find(MESSAGE)
            if at < 0:
                return ParsedToolOutput("")  # unfinished (or never finished): no text yet
            kind = self._open(text[:at], calls)
            pos = at + len(MESSAGE)
        while pos < len(text):
            at, marker = first_of(text, pos, _BODY_STOPS)
            if at < 0:
                hold = 0 if finished else held_back(text[pos:], _BODY_STOPS)
                add(text[pos:len(text) - hold])
                break
            add(text[pos:at])
            if marker in _TERMINATORS:
                pos, kind = at + len(marker), "content"
                continue
            body = text.find(MESSAGE, at)
            if body < 0:
                # A header still being written names nothing yet; one the output never
                # finished (cut by max_tokens) is dropped.
                break
            kind = self._open(text[at:body], calls)
            pos = body + len(MESSAGE)
        return ParsedToolOutput("".join(content), calls)

    @staticmethod
    def _open(header: str, calls: list[FunctionCallDraft]) -> _Kind:
        """What the message a header opens is; a call is listed from its header on."""
        recipient = recipient_of(header)
        if recipient.startswith(FUNCTIONS):
            calls.append(FunctionCallDraft(recipient[len(FUNCTIONS):], ""))
            return "call"
        if recipient or channel_of(header) == REASONING_CHANNEL:
            return "drop"
        return "content"
