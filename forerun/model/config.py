"""Architecture hyper-parameters shared by every supported decoder-only model."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from forerun.model.errors import ModelLoadError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "SmolLM3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
)

# MLP activations by their Hugging Face names (``hidden_act`` / ``hidden_activation``).
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")

# Rope types whose inverse frequencies we know how to compute (see rotary.py); "su" is
# Phi-3's first name for longrope.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = (
    "default", "linear", "dynamic", "yarn", "llama3", "longrope", "su")
# Types whose ``original_max_position_embeddings`` transformers fills in when a config
# leaves it out (the top-level one first, as Phi-3 keeps it, else max_position_embeddings).
_ORIGINAL_CONTEXT_TYPES = ("yarn", "longrope")
# The parameters each type cannot do without (a GGUF's llama3 carries its factors instead).
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",), "llama3": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either the v4 or the v5 transformers layout.

    transformers >= 5 folds both into ``rope_parameters``; older configs use top-level
    ``rope_theta`` and ``rope_scaling``.
    """
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_type = "longrope" if rope_type == "su" else rope_type
        for key in ("type", "rope_theta", "partial_rotary_factor"):
            scaling.pop(key, None)
        if rope_type == "default" and scaling.get("freq_factors") is None:
            scaling = None
        else:
            scaling["rope_type"] = rope_type
        for key in _ROPE_REQUIRED.get(rope_type, ()):
            if scaling.get(key) is None and not (
                    rope_type == "llama3" and scaling.get("freq_factors") is not None):
                raise ModelLoadError(f"{rope_type} rope scaling needs {key!r}")
        if rope_type in _ORIGINAL_CONTEXT_TYPES:
            original = (d.get("original_max_position_embeddings")
                        or scaling.get("original_max_position_embeddings")
                        or d.get("max_position_embeddings") or 2048)
            scaling["original_max_position_embeddings"] = int(original)
    return float(theta), scaling


def _rotary_dim(d: dict[str, Any], head_dim: int) -> int:
    """How many of a head's dimensions rotate: ``partial_rotary_factor`` of them (Phi-4-mini:
    0.75), top level or inside ``rope_parameters``; a GGUF states the count itself."""
    factor = d.get("partial_rotary_factor")
    if factor is None:
        factor = (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    dim = int(d["rotary_dim"]) if d.get("rotary_dim") else int(head_dim * float(factor))
    if not 2 <= dim <= head_dim or dim % 2:
        raise ModelLoadError(f"{dim} rotary dimensions (partial_rotary_factor {factor}) of "
                             f"head_dim {head_dim}; need an even number in 2..{head_dim}")
    return dim


def _nope_layers(arch: str, d: dict[str, Any], layers: int) -> list[int]:
    """The layers that apply no rotary embedding (SmolLM3). Its ``no_rope_layers`` has one
    entry per layer, 1 where the layer *uses* rope (transformers' ``use_rope``); without it,
    every ``no_rope_layer_interval``-th layer (4 by default) is a NoPE layer."""
    if arch != "SmolLM3ForCausalLM":
        return []
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval") or 4)
        return [i for i in range(layers) if (i + 1) % interval == 0]
    if len(flags) != layers:
        raise ModelLoadError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return [i for i, use_rope in enumerate(flags) if not use_rope]


def _check_freq_factors(scaling: dict[str, Any] | None, head_dim: int) -> None:
    """``freq_factors`` (from a GGUF's ``rope_freqs.weight``) must hold one positive finite
    divisor per rotation pair; anything else would rotate silently wrong."""
    factors = (scaling or {}).get("freq_factors")
    if factors is None:
        return
    try:
        values = [float(v) for v in factors]
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"rope freq_factors must be a list of numbers: {exc}") from exc
    if len(values) != head_dim // 2:
        raise ModelLoadError(
            f"rope freq_factors has {len(values)} entries; head_dim {head_dim} needs "
            f"{head_dim // 2}")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ModelLoadError("rope freq_factors must be positive and finite")


def _moe_settings(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Hugging Face config (none for a dense
    architecture). Mixtral's experts are ``intermediate_size`` wide and its router weights
    always renormalised over the chosen experts."""
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"):
        return {}
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    top_k = int(d.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(
            f"{arch} needs 1 <= num_experts_per_tok <= num_experts; got {top_k} of {experts}")
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": int(d["intermediate_size"]), "norm_topk_prob": True}
    if arch == "GptOssForCausalLM":
        # Every layer sparse, experts intermediate_size wide; the router's softmax over the
        # chosen logits sums to 1 by itself. transformers' defaults for the clamped SwiGLU.
        return {"num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": int(d["intermediate_size"]), "norm_topk_prob": True,
                "swiglu_alpha": float(d.get("swiglu_alpha") or 1.702),
                "swiglu_limit": float(d.get("swiglu_limit") or 7.0), "attention_sinks": True}
    step = int(d.get("decoder_sparse_step") or 1)
    if step < 1:
        raise ModelLoadError(f"{arch} needs decoder_sparse_step >= 1; got {step}")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": step,
            "mlp_only_layers": _as_id_list(d.get("mlp_only_layers"))}


def _granite_settings(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars (transformers' defaults where the config omits one)."""
    if arch != "GraniteForCausalLM":
        return {}
    return {"embedding_multiplier": float(d.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(d.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(d.get("attention_multiplier", 1.0)),
            "logits_scaling": float(d.get("logits_scaling", 1.0))}


def _layer_types(arch: str, d: dict[str, Any], layers: int) -> tuple[list[str], int | None]:
    """``(layer_types, sliding_window)`` from a Hugging Face config: its own ``layer_types``
    where it has them (transformers >= 5 writes them for Gemma 2/3 and Qwen2), else the
    pattern each family's modeling code uses. No window, or none in use: ``([], None)``."""
    window = d.get("sliding_window")
    if (arch.startswith("Qwen") or arch == "SmolLM3ForCausalLM") \
            and not d.get("use_sliding_window"):
        window = None  # these configs carry a window they do not use
    if window is None or int(window) >= int(d.get("max_position_embeddings") or 2048):
        return [], None  # none, or one no position can reach past
    window = int(window)
    if window < 1:
        raise ModelLoadError(f"{arch}: sliding_window must be >= 1; got {window}")
    types = d.get("layer_types")
    if types is None:
        if arch in ("Gemma2ForCausalLM", "GptOssForCausalLM"):  # even layers slide
            types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)]
        elif arch == "Gemma3ForCausalLM":  # every n-th layer is global (n = 6)
            n = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
            types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                     for i in range(layers)]
        elif arch.startswith("Qwen"):  # layers from max_window_layers on slide
            first = int(d.get("max_window_layers") or 0)
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(layers)]
        else:  # Mistral, Mixtral: every layer
            types = ["sliding_attention"] * layers
    types = [str(t) for t in types]
    if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ModelLoadError(
            f"{arch}: layer_types must name full_attention or sliding_attention for each of "
            f"the {layers} layers; got {types}")
    return types, window


def _gemma_settings(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's attention scale, soft-capping and local rope base (none elsewhere).

    Gemma 3 in transformers >= 5 nests its rope parameters by layer type; older configs
    give the sliding layers' base as ``rope_local_base_freq``."""
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    out: dict[str, Any] = {
        "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar") or d["head_dim"]),
        "attn_logit_softcapping": d.get("attn_logit_softcapping"),
        "final_logit_softcapping": d.get("final_logit_softcapping"),
    }
    if arch == "Gemma3ForCausalLM":
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
        out["rope_local_theta"] = float(
            d.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
    return out


def _global_rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with per-layer-type ``rope_parameters`` (Gemma 3) reduced to the global ones."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return {**d, "rope_parameters": params["full_attention"]}
    return d


@dataclass(slots=True)
class ModelConfig:
    """The hyper-parameters forerun needs to build and run a model, independent of file format."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # HF ``rope_scaling``; from a GGUF it may also carry ``freq_factors`` (rotary.py).
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str | None = None
    # Mixture of experts (0 experts: a dense model): each sparse layer's MLP is
    # num_experts gated-SiLU experts of width moe_intermediate_size, num_experts_per_tok of
    # them per token, their router weights renormalised over the chosen ones when
    # norm_topk_prob. Qwen3-MoE's mlp_only_layers and decoder_sparse_step say which layers
    # are sparse (is_moe_layer); Mixtral's are all.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Attention type per layer, in Hugging Face's ``layer_types`` words ("full_attention",
    # "sliding_attention"); empty means every layer is full attention. A sliding layer
    # attends to the last ``sliding_window`` positions, its own included.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    # Rotary: the leading ``rotary_dim`` dimensions of each head rotate (0: all of
    # head_dim); layers in ``nope_layers`` apply none (SmolLM3's NoPE layers).
    rotary_dim: int = 0
    nope_layers: list[int] = field(default_factory=list)
    # Granite's scalars: embeddings times ``embedding_multiplier``, each block's attention
    # and MLP output times ``residual_multiplier`` before its residual add, attention scores
    # times ``attention_multiplier`` (None: head_dim ** -0.5), logits divided by
    # ``logits_scaling``.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # The engine's context length (forerun/model/info.py sets it; None: max_position_
    # embeddings). longrope picks its factor set by it, as vLLM does.
    max_model_len: int | None = None

    @property
    def rope_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    def uses_long_rope_factors(self) -> bool | None:
        """longrope: whether the long factors apply (the context is longer than the one
        the model was pretrained at); None for other rope types."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        context = self.max_model_len or self.max_position_embeddings
        return context > int(scaling["original_max_position_embeddings"])
    # The MLP's activation (a Hugging Face name from SUPPORTED_ACTIVATIONS).
    hidden_act: str = "silu"
    # Gemma: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), scores
    # soft-capped as c * tanh(s / c) for c = attn_logit_softcapping, logits likewise for
    # final_logit_softcapping (None: no capping), and the sliding layers' rope base
    # rope_local_theta, unscaled (None: every layer uses rope_theta and rope_scaling).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # gpt-oss: a learned logit per query head in each attention softmax's denominator, and
    # experts (with biases, behind a biased router) whose activation is the clamped SwiGLU
    # with these two constants (None: SiLU-and-multiply).
    attention_sinks: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def layer_window(self, layer: int) -> int | None:
        """How many positions decoder layer ``layer`` attends to (its own included), or
        None for full attention. The KV cache manager groups layers by this."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe_layer(self, layer: int) -> bool:
        """True if decoder layer ``layer``'s MLP is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(
        cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (and optional ``generation_config.json``).

        The generation config wins for EOS ids because chat models often list extra stop
        tokens there (e.g. ``<|eot_id|>``) that config.json lacks.
        """
        archs = d.get("architectures") or []
        if not archs:
            raise ModelLoadError(
                "config.json has no 'architectures' entry; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model architecture {arch!r}; "
                f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("use_sliding_window") and not arch.startswith("Qwen"):
            raise ModelLoadError(f"{arch} with use_sliding_window=true is not supported")
        if d.get("mlp_bias"):
            raise ModelLoadError(f"{arch} with mlp_bias=true is not supported")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        layers = int(d["num_hidden_layers"])
        layer_types, window = _layer_types(arch, d, layers)
        act = str(d.get("hidden_activation") or d.get("hidden_act") or "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"{arch}: unsupported activation {act!r}; supported: "
                                 f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        theta, scaling = _rope_settings(_global_rope_dict(d))
        _check_freq_factors(scaling, head_dim)
        # Qwen2 always has q/k/v biases; its config does not say so.
        attention_bias = True if arch == "Qwen2ForCausalLM" else bool(d.get("attention_bias"))
        moe = _moe_settings(arch, d)
        gemma = _gemma_settings(arch, {**d, "head_dim": head_dim})
        rotary_dim = _rotary_dim(d, head_dim)
        eos = _as_id_list((generation_config or {}).get("eos_token_id"))
        if not eos:
            eos = _as_id_list(d.get("eos_token_id"))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(d["vocab_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            rope_theta=theta,
            rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
            rope_scaling=scaling,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            nope_layers=_nope_layers(arch, d, layers),
            **_granite_settings(arch, d),
            layer_types=layer_types,
            sliding_window=window,
            hidden_act=act,
            **moe,
            **gemma,
        )
