"""What Ollama's ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model,
from its config alone (no weights are read): family, parameter count, precision, context
length, chat template and capabilities."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from forerun.engine.async_llm import AsyncLLM
from forerun.model.config import ModelConfig
from forerun.model.gguf_file import GGUF_ARCHITECTURES

logger = logging.getLogger(__name__)

# HF architecture -> the name llama.cpp and Ollama give the family (Mixtral is "llama").
_FAMILIES = {hf: name for name, hf in GGUF_ARCHITECTURES.items()}
_FAMILIES["MixtralForCausalLM"] = "llama"
_DTYPE_LEVELS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# The model never unloads: ps shows it expiring at the end of time, as Ollama does for a
# keep_alive of -1 (forever).
_NEVER = "2318-01-01T00:00:00Z"


def rfc3339(t: datetime | None = None) -> str:
    """A UTC time as Ollama writes it (``2024-01-01T12:00:00.123456Z``)."""
    return (t or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


def parameter_count(mc: ModelConfig) -> int:
    """Weights in the model, from its shape (norms included, biases left out)."""
    h, heads, kv, d = mc.hidden_size, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    attention = h * heads * d * 2 + h * kv * d * 2
    dense = 3 * h * mc.intermediate_size
    total = 0
    for layer in range(mc.num_hidden_layers):
        if mc.num_experts and mc.is_moe_layer(layer):
            mlp = mc.num_experts * 3 * h * mc.moe_intermediate_size + h * mc.num_experts
        else:
            mlp = dense
        total += attention + mlp + 2 * h
    embed = mc.vocab_size * h
    return total + embed * (1 if mc.tie_word_embeddings else 2) + h


def parameter_size(n: int) -> str:
    """Ollama's rounding: ``134.52M``, ``7.6B``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


@dataclass(slots=True)
class ModelFacts:
    """The served model as Ollama's listing routes describe it (computed once)."""

    family: str
    format: str
    parameters: int
    quantization_level: str
    context_length: int
    modified_at: str
    digest: str
    size: int
    on_gpu: bool
    config: ModelConfig

    @classmethod
    def of(cls, engine: AsyncLLM) -> ModelFacts:
        info, cfg = engine.model_info, engine.config
        mc = info.model_config
        family = _FAMILIES.get(mc.architecture, mc.architecture.removesuffix("ForCausalLM")
                               .lower())
        device = cfg.resolve_device()
        dtype = str(cfg.resolve_dtype(device)).removeprefix("torch.")
        level = _DTYPE_LEVELS.get(dtype, dtype.upper())
        if cfg.quantization == "int8":
            level = "Q8_0"  # int8 weights per output channel: Ollama's nearest name
        elif cfg.quantization == "gguf":
            level = _gguf_level(info.source.gguf_path) or level
        source = info.source
        path = source.gguf_path if source.is_gguf else source.path
        try:
            modified = rfc3339(datetime.fromtimestamp(path.stat().st_mtime, UTC))
        except OSError:
            modified = rfc3339()
        n = parameter_count(mc)
        per_weight = {"F32": 4, "BF16": 2, "F16": 2, "Q8_0": 1}.get(level, 1)
        return cls(family, "gguf" if source.is_gguf else "safetensors", n, level,
                   info.max_model_len, modified,
                   hashlib.sha256(str(path).encode()).hexdigest(), n * per_weight,
                   device.type == "cuda", mc)

    def details(self) -> dict[str, Any]:
        return {"parent_model": "", "format": self.format, "family": self.family,
                "families": [self.family], "parameter_size": parameter_size(self.parameters),
                "quantization_level": self.quantization_level}

    def model_info(self) -> dict[str, Any]:
        """GGUF-style keys, as Ollama's ``model_info`` has them."""
        mc, a = self.config, self.family
        out: dict[str, Any] = {
            "general.architecture": a,
            "general.parameter_count": self.parameters,
            f"{a}.context_length": mc.max_position_embeddings,
            f"{a}.embedding_length": mc.hidden_size,
            f"{a}.block_count": mc.num_hidden_layers,
            f"{a}.feed_forward_length": mc.intermediate_size,
            f"{a}.attention.head_count": mc.num_attention_heads,
            f"{a}.attention.head_count_kv": mc.num_key_value_heads,
            f"{a}.attention.key_length": mc.head_dim,
            f"{a}.attention.value_length": mc.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": mc.rms_norm_eps,
            f"{a}.rope.freq_base": mc.rope_theta,
            f"{a}.vocab_size": mc.vocab_size,
        }
        if mc.num_experts:
            out[f"{a}.expert_count"] = mc.num_experts
            out[f"{a}.expert_used_count"] = mc.num_experts_per_tok
        return out

    def tag(self, name: str) -> dict[str, Any]:
        return {"name": name, "model": name, "modified_at": self.modified_at,
                "size": self.size, "digest": self.digest, "details": self.details()}

    def process(self, name: str) -> dict[str, Any]:
        return {**self.tag(name), "expires_at": _NEVER,
                "size_vram": self.size if self.on_gpu else 0,
                "context_length": self.context_length}


def _gguf_level(path: Any) -> str | None:
    """The GGUF file's type name (``Q4_1``, ``Q8_0``...), the level it computes with."""
    try:
        import gguf

        from forerun.model.gguf_file import _field, open_gguf

        ftype = _field(open_gguf(path), "general.file_type")
        if ftype is None:
            return None
        return gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
    except Exception as exc:  # metadata only: an odd file must not break /api/show
        logger.warning("could not read the GGUF file type of %s: %s", path, exc)
        return None


# Tools work with any model: with --tool-call-parser the model's own text is parsed, without
# one the calls are forced by structured output (forerun/server/ollama.py).
CAPABILITIES = ("completion", "tools")
