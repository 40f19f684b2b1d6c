"""The interface of a tool-call parser: model text -> content and function calls.

A parser says how far a text has got (``parse``); the whole-response and streaming
extractions are both derived from that, so streamed deltas always add up to the same calls
as the whole response.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class FunctionCallDraft:
    """A function call as far as the text goes: its name and its arguments' JSON text so far."""

    name: str
    arguments: str


@dataclass(slots=True)
class ParsedToolOutput:
    """What a text holds so far: the content to show and the calls found, in order."""

    content: str
    calls: list[FunctionCallDraft] = field(default_factory=list)


@dataclass(slots=True)
class ExtractedToolCallInformation:
    """A whole response split into tool calls and content (None: no content)."""

    tools_called: bool
    tool_calls: list[FunctionCallDraft]
    content: str | None


@dataclass(slots=True)
class DeltaToolCall:
    """What one call gained: ``name`` is set only on the call's first delta."""

    index: int
    name: str | None
    arguments: str


@dataclass(slots=True)
class DeltaMessage:
    """What a streamed choice gained since the previous delta."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Finds function calls in a model's output; one instance per streamed choice.

    Subclasses implement :meth:`parse`; its result for a prefix of a text must be a prefix
    of its result for the text (content and each call's arguments only grow), which is what
    lets the streamed deltas reassemble exactly to :meth:`extract_tool_calls`.
    """

    # Whether the parser reads the model's whole text even under --reasoning-parser (and
    # leaves the reasoning out of its content itself), rather than the reasoning parser's
    # content: harmony's calls are named in headers, which that content no longer holds.
    reads_whole_output: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self._sent_content = 0
        self._sent_args: list[int] = []

    def adjust_request(self, request: Any) -> Any:
        """The request to run instead (e.g. keep the special tokens the format uses)."""
        return request

    @abstractmethod
    def parse(self, text: str, finished: bool) -> ParsedToolOutput:
        """Content and calls in ``text``; ``finished``: no more text will come.

        While unfinished, text that may still turn into a call (a partial tag) is held back
        from the content, and a call appears once its name is whole.
        """

    def extract_tool_calls(self, model_output: str,
                           request: Any = None) -> ExtractedToolCallInformation:
        """The calls and content of a whole response."""
        parsed = self.parse(model_output, finished=True)
        return ExtractedToolCallInformation(bool(parsed.calls), parsed.calls,
                                            parsed.content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, request: Any = None,
                                     finished: bool = False) -> DeltaMessage | None:
        """What ``current_text`` adds to what earlier calls returned; None if nothing.

        ``finished`` on the last call releases anything held back.
        """
        parsed = self.parse(current_text, finished)
        delta = DeltaMessage()
        if len(parsed.content) > self._sent_content:
            delta.content = parsed.content[self._sent_content:]
            self._sent_content = len(parsed.content)
        for k, call in enumerate(parsed.calls):
            if k == len(self._sent_args):
                self._sent_args.append(len(call.arguments))
                delta.tool_calls.append(DeltaToolCall(k, call.name, call.arguments))
            elif len(call.arguments) > self._sent_args[k]:
                delta.tool_calls.append(
                    DeltaToolCall(k, None, call.arguments[self._sent_args[k]:]))
                self._sent_args[k] = len(call.arguments)
        if delta.content is None and not delta.tool_calls:
            return None
        return delta
