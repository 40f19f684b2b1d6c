"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's options switched on.

Both: RMSNorm weights w scale by (1 + w); every attention and MLP output is normed before
its residual add (sandwich norms); embeddings scaled by sqrt(hidden_size); a GeGLU MLP
(``hidden_activation``); attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding
and global layers from ``layer_types``; final logits soft-capped where the config says.
Gemma 2 also soft-caps the attention scores; Gemma 3 adds q/k norms and rotates its
sliding layers by their own base (``rope_local_theta``). All of it is read from
ModelConfig by forerun/model/llama.py.
"""

from forerun.model.llama import LlamaForCausalLM, SandwichNormDecoderLayer


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder."""

    decoder_layer_cls = SandwichNormDecoderLayer
    norm_offset = 1.0
    scale_embeddings = True


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder (``Gemma3TextConfig``): Gemma 2 plus per-head q/k norms."""

    qk_norm = "head"
