"""OLMo 2: norms after the attention and MLP blocks instead of before them, and q/k RMSNorm
over the whole q and k projections (not per head)."""

from forerun.model.llama import LlamaForCausalLM, PostNormDecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 decoder."""

    qk_norm = "full"
    decoder_layer_cls = PostNormDecoderLayer
