"""Reasoning parsers, by the names ``--reasoning-parser`` takes (vLLM's names)."""

from __future__ import annotations

from forerun.reasoning.abs_reasoning_parser import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    Segment,
)
from forerun.reasoning.harmony import GptOssReasoningParser
from forerun.reasoning.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "GptOssReasoningParser", "Qwen3ReasoningParser",
           "ReasoningDelta", "ReasoningParser", "ReasoningParserManager", "ReasoningSplit",
           "Segment"]


class ReasoningParserManager:
    """The registry of parsers by name."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = {
        "deepseek_r1": DeepSeekR1ReasoningParser,
        "qwen3": Qwen3ReasoningParser,
        "openai_gptoss": GptOssReasoningParser,
    }

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class registered as ``name``; KeyError lists the known names."""
        try:
            return cls.reasoning_parsers[name]
        except KeyError:
            raise KeyError(f"reasoning parser {name!r} is not registered; known: "
                           f"{', '.join(sorted(cls.reasoning_parsers))}") from None
