"""forerun: an LLM inference and serving engine built around async scheduling."""

from forerun.llm import LLM
from forerun.outputs import CompletionOutput, RequestOutput
from forerun.sampling_params import SamplingParams
from forerun.structured.params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
