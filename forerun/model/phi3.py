"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder with checkpoints that already fuse q/k/v
(``qkv_proj``) and gate/up (``gate_up_proj``, gate rows first), partial rotary where the
config says so (Phi-4-mini), and LongRoPE scaling (forerun/model/rotary.py)."""

from forerun.model.base import Shard
from forerun.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder; its fused projections load as they are, into one linear each."""

    def packed_shards(self) -> dict[str, Shard]:
        return {}
