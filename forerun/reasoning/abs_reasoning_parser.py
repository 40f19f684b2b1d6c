"""The interface of a reasoning parser: model text -> the model's thinking and its answer.

A parser says how a text divides (:meth:`ReasoningParser.split`) into segments of
reasoning, content and markup (the tags and headers that delimit them); the whole-response
and streaming extractions are both derived from that one split, so streamed deltas always
add up to what the whole response gives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

SegmentKind = Literal["reasoning", "content", "markup"]


@dataclass(slots=True)
class Segment:
    """One run of the model's text: thinking, answer, or the markup between them."""

    kind: SegmentKind
    text: str


@dataclass(slots=True)
class ReasoningSplit:
    """A text's segments in order. Finished, they are the whole text; unfinished, a prefix
    of it (text that may still turn into markup, such as half a tag, is held back)."""

    segments: list[Segment] = field(default_factory=list)

    def add(self, kind: SegmentKind, text: str) -> None:
        if text:  # empty runs carry nothing and would only make comparisons noisy
            self.segments.append(Segment(kind, text))

    def _joined(self, kind: SegmentKind) -> str:
        return "".join(s.text for s in self.segments if s.kind == kind)

    @property
    def reasoning(self) -> str:
        return self._joined("reasoning")

    @property
    def content(self) -> str:
        return self._joined("content")

    @property
    def text(self) -> str:
        """Every segment's text, markup included: the parsed text itself."""
        return "".join(s.text for s in self.segments)


@dataclass(slots=True)
class ReasoningDelta:
    """What a streamed choice gained since the previous delta (None: nothing of that kind).

    ``content_so_far`` is the whole content up to now, which a tool-call parser downstream
    takes as its text.
    """

    reasoning: str | None = None
    content: str | None = None
    content_so_far: str = ""


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``markers``:
    a tag may arrive split across stream chunks, so its first half must wait."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return n
    return 0


class ReasoningParser(ABC):
    """Splits a model's output into reasoning and content; one instance per streamed choice.

    Subclasses implement :meth:`split`; the reasoning and the content it finds in a prefix
    of a text must be prefixes of those it finds in the text (they only grow), which is what
    lets the streamed deltas reassemble exactly to :meth:`extract_reasoning`.
    """

    # Whether a forced tool call's grammar (tool_choice required or named) also waits for
    # the reasoning to end: only where the answer is where the model would put a call.
    forced_calls_after_reasoning: ClassVar[bool] = True

    def __init__(self, tokenizer: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self._sent_reasoning = 0
        self._sent_content = 0

    def adjust_request(self, request: Any) -> Any:
        """The request to run instead (e.g. keep the special tokens the format uses)."""
        return request

    @abstractmethod
    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """The segments of ``text``; ``finished``: no more text will come."""

    @abstractmethod
    def answer_start(self, text: str) -> int | None:
        """Where the answer begins in ``text`` (the output so far): the index just past the
        marker that ends the reasoning, or None while the model is still reasoning.

        Structured output constrains only what follows (vLLM's ``is_reasoning_end``): the
        engine asks this of each longer output until it answers. Once the marker is found
        more text must not move it.
        """

    def reasoning_ended_in_prompt(self, prompt: str) -> bool:
        """Whether the prompt already closed the reasoning, so that the whole output is the
        answer (Qwen3's template with ``enable_thinking: false``)."""
        return False

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole response; None where there is none."""
        parsed = self.split(model_output, finished=True)
        return parsed.reasoning or None, parsed.content or None

    def extract_reasoning_streaming(self, current_text: str,
                                    finished: bool = False) -> ReasoningDelta:
        """What ``current_text`` (the whole text so far) adds to what earlier calls
        returned; ``finished`` on the last call releases anything held back."""
        parsed = self.split(current_text, finished)
        reasoning, content = parsed.reasoning, parsed.content
        delta = ReasoningDelta(content_so_far=content)
        if len(reasoning) > self._sent_reasoning:
            delta.reasoning = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            delta.content = content[self._sent_content:]
            self._sent_content = len(content)
        return delta
