"""Parsers for models that think between ``<think>`` and ``</think>`` (vLLM's names)."""

from __future__ import annotations

from typing import Any

from forerun.reasoning.abs_reasoning_parser import ReasoningParser, ReasoningSplit, held_back

THINK_START = "<think>"
THINK_END = "</think>"


def _thought_then_answer(text: str, pos: int, finished: bool, out: ReasoningSplit) -> None:
    """From ``pos`` (just inside a thought): reasoning up to ``</think>``, then content.

    A thought the output never closes (cut by max_tokens) is all reasoning: while
    streaming it was already sent as such, and the whole response must agree.
    """
    end = text.find(THINK_END, pos)
    if end < 0:
        hold = 0 if finished else held_back(text[pos:], (THINK_END,))
        out.add("reasoning", text[pos:len(text) - hold])
        return
    out.add("reasoning", text[pos:end])
    out.add("markup", THINK_END)
    # Past the thought nothing is parsed: an answer may mention the tags themselves.
    out.add("content", text[end + len(THINK_END):])


class _ThinkTagParser(ReasoningParser):
    """What both tag parsers share: keeping the tags in the text where they are special, and
    the answer starting after the first ``</think>``."""

    def answer_start(self, text: str) -> int | None:
        end = text.find(THINK_END)
        return None if end < 0 else end + len(THINK_END)

    def adjust_request(self, request: Any) -> Any:
        # Most tokenizers give <think> as a plain added token, which the output text keeps;
        # where it is a special token, skipping those would erase the tags. Only there:
        # keeping special tokens would also keep the end-of-turn token's text.
        special = getattr(self.model_tokenizer, "all_special_tokens", None) or ()
        if (THINK_START in special or THINK_END in special) \
                and getattr(request, "skip_special_tokens", False):
            return request.model_copy(update={"skip_special_tokens": False})
        return request


class DeepSeekR1ReasoningParser(_ThinkTagParser):
    """DeepSeek-R1 and its distills (``deepseek_r1``): everything before ``</think>`` is
    reasoning. Their chat templates end the prompt with ``<think>``, so the output usually
    starts inside the thought; an output that starts with ``<think>`` itself is read the
    same way, the tag dropped."""

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        pos = 0
        if text.startswith(THINK_START):
            out.add("markup", THINK_START)
            pos = len(THINK_START)
        elif not finished and THINK_START.startswith(text):
            return out  # may still become the start tag
        _thought_then_answer(text, pos, finished, out)
        return out


class Qwen3ReasoningParser(_ThinkTagParser):
    """Qwen3 (``qwen3``): reasoning only inside ``<think>...</think>``; an output without
    the start tag (``enable_thinking=False``) is all content."""

    def reasoning_ended_in_prompt(self, prompt: str) -> bool:
        # Qwen3's template with thinking off ends the prompt with an empty thought; the
        # model then answers at once, with no <think> of its own.
        return prompt.rfind(THINK_END) > prompt.rfind(THINK_START)

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        start = text.find(THINK_START)
        if start < 0:
            hold = 0 if finished else held_back(text, (THINK_START,))
            out.add("content", text[:len(text) - hold])
            return out
        out.add("content", text[:start])
        out.add("markup", THINK_START)
        _thought_then_answer(text, start + len(THINK_START), finished, out)
        return out
