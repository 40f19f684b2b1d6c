"""Qwen2 / Qwen2.5: Llama with q/k/v biases (and none on o_proj)."""

from forerun.model.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder; ``ModelConfig.from_hf_dict`` forces ``attention_bias`` on for it."""

    o_proj_follows_attention_bias = False
