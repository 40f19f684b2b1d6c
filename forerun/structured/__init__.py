"""Structured output: constrain generation to a JSON schema, regex, choice or grammar."""

from forerun.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
