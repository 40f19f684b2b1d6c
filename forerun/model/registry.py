"""Maps Hugging Face architecture names to forerun model classes."""

from __future__ import annotations

from forerun.model.base import CausalLM
from forerun.model.config import SUPPORTED_ARCHITECTURES
from forerun.model.errors import ModelLoadError
from forerun.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from forerun.model.gpt_oss import GptOssForCausalLM
from forerun.model.granite import GraniteForCausalLM
from forerun.model.llama import LlamaForCausalLM
from forerun.model.mistral import MistralForCausalLM
from forerun.model.moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM
from forerun.model.olmo2 import Olmo2ForCausalLM
from forerun.model.phi3 import Phi3ForCausalLM
from forerun.model.qwen2 import Qwen2ForCausalLM
from forerun.model.qwen3 import Qwen3ForCausalLM
from forerun.model.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)

__all__ = ["MODEL_REGISTRY", "CausalLM", "get_model_class"]


def get_model_class(arch: str) -> type[CausalLM]:
    """The model class for a Hugging Face architecture name, or a ``ModelLoadError``."""
    cls = MODEL_REGISTRY.get(arch)
    if cls is None:
        raise ModelLoadError(
            f"unsupported model architecture {arch!r}; "
            f"supported architectures: {', '.join(MODEL_REGISTRY)}"
        )
    return cls
