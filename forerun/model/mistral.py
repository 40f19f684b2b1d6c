"""Mistral: the Llama decoder with every layer's attention over a sliding window
(``sliding_window`` in its config; None in later releases, where it is plain Llama)."""

from forerun.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral decoder; ``ModelConfig.from_hf_dict`` marks its layers sliding."""
