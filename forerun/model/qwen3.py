"""Qwen3 dense: Llama plus per-head RMSNorm on queries and keys before rotary."""

from forerun.model.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder with q_norm/k_norm."""

    qk_norm = "head"
