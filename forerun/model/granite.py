"""Granite 3: the Llama decoder with four scalars from its config (ModelConfig's
``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` and
``logits_scaling``), which the shared layers apply."""

from forerun.model.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite decoder (dense)."""
