"""forerun: an LLM inference and serving engine built around async scheduling."""

from typing import TYPE_CHECKING, Any

from forerun.outputs import CompletionOutput, RequestOutput
from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams
from forerun.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from forerun.llm import LLM

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM is imported on first use: it pulls in the builder, the worker and the model code,
    # which the API process (``forerun serve``) never needs.
    if name == "LLM":
        from forerun.llm import LLM

        return LLM
    raise AttributeError(f"module 'forerun' has no attribute {name!r}")
