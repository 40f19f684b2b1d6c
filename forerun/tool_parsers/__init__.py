"""Tool-call parsers, by the names ``--tool-call-parser`` takes (vLLM's names)."""

from __future__ import annotations

from forerun.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCallDraft,
    ParsedToolOutput,
    ToolParser,
)
from forerun.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from forerun.tool_parsers.openai_tool_parser import OpenAIToolParser

__all__ = ["DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation",
           "FunctionCallDraft", "Hermes2ProToolParser", "OpenAIToolParser", "ParsedToolOutput",
           "ToolParser", "ToolParserManager"]


class ToolParserManager:
    """The registry of parsers by name."""

    tool_parsers: dict[str, type[ToolParser]] = {"hermes": Hermes2ProToolParser,
                                                 "openai": OpenAIToolParser}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class registered as ``name``; KeyError lists the known names."""
        try:
            return cls.tool_parsers[name]
        except KeyError:
            raise KeyError(f"tool call parser {name!r} is not registered; known: "
                           f"{', '.join(sorted(cls.tool_parsers))}") from None
