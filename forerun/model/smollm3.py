"""SmolLM3: the Llama decoder with NoPE layers (ModelConfig.nope_layers: every fourth layer
by default attends without rotary)."""

from forerun.model.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 decoder."""
