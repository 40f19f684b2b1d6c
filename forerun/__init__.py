"""forerun: an LLM inference and serving engine built around async scheduling."""

from forerun.llm import LLM
from forerun.outputs import CompletionOutput, RequestOutput
from forerun.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
