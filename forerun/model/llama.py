"""Llama-family decoder: the base of every dense and MoE family here, which differ from it
only by options (class attributes and ModelConfig fields): q/k norm per head (Qwen3) or over
the whole projection (OLMo 2), norms before (Llama) or after (OLMo 2) each block, Gemma's
sandwich norms, (1 + w) weights, scaled embeddings and soft-capping, sliding windows
(Mistral, Gemma), Granite's multipliers, partial rotary and NoPE layers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from forerun import envs
from forerun.model.attention import AttentionMetadata, KVCache, paged_attention
from forerun.model.base import CausalLM, Shard
from forerun.model.config import ModelConfig
from forerun.model.layers import GatedMLP, RMSNorm
from forerun.model.packed_linear import PackedLinear, TileLinear, prepack_linears
from forerun.model.rotary import RotaryEmbedding, RotaryTables, apply_rotary
from forerun.model.small_batch import SmallBatchStack

if TYPE_CHECKING:
    from forerun.model.quant.gguf_linear import GGUFLinear

# Where a layer's q/k RMSNorm applies: per head over head_dim (Qwen3), or over the whole
# q and k projections before they split into heads (OLMo 2); None: no q/k norm.
QKNorm = Literal["head", "full"] | None

logger = logging.getLogger(__name__)


class DecoderAttention(nn.Module):
    """Self-attention with fused q/k/v projection, optional q/k norm, paged cache;
    decoder layer ``layer``'s sliding window, the config's score soft-capping and
    attention sinks."""

    def __init__(self, config: ModelConfig, o_proj_bias: bool, qk_norm: QKNorm,
                 layer: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.attention_multiplier if config.attention_multiplier is not None
                      else (config.query_pre_attn_scalar or self.head_dim) ** -0.5)
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcapping
        # SmolLM3's NoPE layers attend without positions.
        self.use_rope = layer not in config.nope_layers
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_proj_bias)
        self.qk_norm = qk_norm
        q_dim, k_dim = ((self.q_size, self.kv_size) if qk_norm == "full"
                        else (self.head_dim, self.head_dim))
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if qk_norm else None
        # gpt-oss: a learned logit per query head in every softmax's denominator.
        self.sinks = (nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
                      if config.attention_sinks else None)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.qk_norm is not None:
            # The norms return new, contiguous q and k; v must be laid out like k (rows
            # equally far apart) for the C attention kernels, or every step of Qwen3, OLMo 2
            # and Gemma 3 took the pure-torch path (one masked SDPA over whole prompts,
            # gathered decodes). A copy of v is small beside the projections.
            v = v.contiguous()
        if self.use_rope:
            q = apply_rotary(q, rotary)
            k = apply_rotary(k, rotary)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              self.window, self.softcap, self.sinks, kv_cache[2:])
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and gated MLP, each with a residual."""

    def __init__(self, config: ModelConfig, o_proj_bias: bool, qk_norm: QKNorm,
                 mlp: nn.Module, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, o_proj_bias, qk_norm, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        # Granite scales each block's output before its residual add.
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` is the previous layer's output before its residual add (which is fused
        into this layer's first norm); returns this layer's output and the residual."""
        h, residual = self._input_norm(x, residual)
        h = self.self_attn(h, rotary, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        h = self.mlp(h)
        if self.residual_multiplier != 1.0:
            h = h * self.residual_multiplier
        return h, residual

    def _input_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed input, the residual stream with ``x`` added)."""
        if residual is None:
            return self.input_layernorm(x), x
        return self.input_layernorm.forward_with_residual(x, residual)


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's block: no norm before attention or the MLP; each one's output is normed
    (``post_attention_layernorm``, ``post_feedforward_layernorm``) before its residual add."""

    def __init__(self, config: ModelConfig, o_proj_bias: bool, qk_norm: QKNorm,
                 mlp: nn.Module, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, o_proj_bias, qk_norm, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`DecoderLayer.forward`: returns the normed MLP output and
        the residual it is still to be added to."""
        hidden = x if residual is None else x + residual
        h = self.post_attention_layernorm(self.self_attn(hidden, rotary, kv_cache, meta))
        hidden = hidden + h
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class SandwichNormDecoderLayer(DecoderLayer):
    """Gemma 2/3's block: the pre-norm block with the attention and MLP outputs normed too,
    before their residual adds: ``post_attention_layernorm`` norms the attention output and
    ``pre_feedforward_layernorm`` the MLP input (Llama's ``post_attention_layernorm``)."""

    def __init__(self, config: ModelConfig, o_proj_bias: bool, qk_norm: QKNorm,
                 mlp: nn.Module, layer: int = 0) -> None:
        super().__init__(config, o_proj_bias, qk_norm, mlp, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTables,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Same contract as :meth:`DecoderLayer.forward`."""
        h, residual = self._input_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rotary, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm.forward_with_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


LayerClass = type[DecoderLayer] | type[PostNormDecoderLayer]


class DecoderStack(nn.Module):
    """Embedding, the decoder layers and the final norm (``model.*`` in checkpoints)."""

    def __init__(self, config: ModelConfig, o_proj_bias: bool, qk_norm: QKNorm,
                 make_mlp: Callable[[int], nn.Module], layer_cls: LayerClass = DecoderLayer
                 ) -> None:
        super().__init__()
        # An explicit (empty) weight skips nn.Embedding's random init: on the meta device
        # that init imports torch._dynamo, 2-3 s of every process's model load.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            layer_cls(config, o_proj_bias, qk_norm, make_mlp(i), i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama / SmolLM-style dense decoder, and the base of the other families."""

    # Qwen2 keeps q/k/v biases but has none on o_proj; Llama and Qwen3 tie both to one flag.
    o_proj_follows_attention_bias: bool = True
    qk_norm: QKNorm = None
    # Norms before each block (Llama), after (OLMo 2) or both (Gemma).
    decoder_layer_cls: LayerClass = DecoderLayer
    # Gemma: its checkpoints' RMSNorm weights w scale by (1 + w), so every norm holds
    # w + norm_offset (added at load: one multiply per norm, and the C kernel unchanged);
    # embeddings scaled by sqrt(hidden_size).
    norm_offset: float = 0.0
    scale_embeddings: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        o_bias = config.attention_bias and self.o_proj_follows_attention_bias
        self.model = DecoderStack(config, o_bias, self.qk_norm, self.make_mlp,
                                  self.decoder_layer_cls)
        # With tied embeddings there is no separate lm_head parameter at all, so nothing can
        # untie them (e.g. materialising from the meta device) and checkpoints need not have it.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.rope_dim, config.max_position_embeddings,
                                      bool(config.uses_long_rope_factors()))
        # Gemma 3's sliding layers rotate by their own (unscaled) base.
        self.rotary_local = (None if config.rope_local_theta is None else
                             RotaryEmbedding(config.head_dim, config.rope_local_theta, None))
        # The tied output projection in oneDNN's layout (or the small-batch path's packed
        # copy, TileLinear), next to the embedding it shares values with (the embedding
        # lookup needs the plain rows); set by ``prepack``.
        self.packed_tied_head: nn.Module | None = None
        # quantization="gguf": the output head over GGUF blocks (the tied embedding's, or
        # lm_head's own); set by the loader (forerun/model/quant/gguf_linear.py).
        self.quant_head: GGUFLinear | None = None
        # Tensor parallel: the vocabulary-parallel output head (logits gathered over the
        # ranks); set by forerun/distributed/tensor_parallel.py.
        self.tp_head: nn.Module | None = None
        # Steps of a few tokens run every layer in one C call (see small_batch.py).
        self.small_batch = SmallBatchStack(self)
        self.requires_grad_(False)

    def make_mlp(self, layer: int) -> nn.Module:
        """Decoder layer ``layer``'s MLP: the dense gated SiLU MLP (the MoE models override)."""
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size,
                        self.config.hidden_act)

    def packed_shards(self) -> dict[str, Shard]:
        c = self.config
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        i = c.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, i),
            "up_proj": ("gate_up_proj", i, i),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.norm_offset:
            # In float32, as Gemma's own norm adds it (then one rounding to the model dtype).
            weights = ((n, t.float() + self.norm_offset if n.endswith("norm.weight") else t)
                       for n, t in weights)
        super().load_weights(weights)

    def skip_weight(self, name: str) -> bool:
        if self.lm_head is None and name == "lm_head.weight":
            return True
        return super().skip_weight(name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rotary = self.rotary.tables(positions)
        local = rotary if self.rotary_local is None else self.rotary_local.tables(positions)
        residual: torch.Tensor | None = None
        if intermediate is None:
            x = self.model.embed_tokens(input_ids)
            if self.config.embedding_multiplier != 1.0:
                x = x * self.config.embedding_multiplier
            if self.scale_embeddings:
                # The factor rounded to the model dtype first, as Gemma does.
                x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
            if self.small_batch.applies(x) and len(self.model.layers) > 0:
                return self.small_batch.forward(x, rotary.cos_half, rotary.sin_half,
                                                kv_caches, attn_metadata)
        else:
            x, residual = intermediate[0], intermediate[1]
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            tables = local if layer.self_attn.window is not None else rotary
            x, residual = layer(x, residual, tables, kv_cache, attn_metadata.for_layer(i))
        if self.pp_stage is not None and not self.pp_stage.is_last:
            assert residual is not None  # every stage holds at least one layer
            return torch.stack([x, residual])
        if residual is None:  # a model without layers
            return self.model.norm(x)
        return self.model.norm.forward_with_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._logits(hidden)
        if self.config.logits_scaling != 1.0:  # Granite divides its logits
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_head is not None:
            return self.tp_head(hidden)
        if self.quant_head is not None:
            return self.quant_head.logits(hidden)
        if self.small_batch.applies(hidden):
            return self.small_batch.logits(hidden)
        if self.packed_tied_head is not None:
            return self.packed_tied_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return (hidden @ self.model.embed_tokens.weight.t()).float()

    def prepack(self) -> int:
        # The small-batch path packs its copy from the plain weights, which prepacking drops;
        # where it cannot run, no copy is made and the path stays off.
        dtype = next(self.parameters()).dtype
        # TP and PP turn the path off before this (it runs every layer in one call).
        if (envs.small_batch_tokens() != 0 and self.small_batch.available
                and self.small_batch.can_run(dtype)):
            self.small_batch.pack()
        else:
            self.small_batch.available = False
        tiled: dict[str, TileLinear] = {}
        if self.small_batch.serves_every_step(dtype):
            # One copy of the weights: the small-batch path's, for steps of every size.
            tiled = self.small_batch.tile_linears()
            if self.lm_head is not None:
                self.lm_head = tiled["head"]
        n = prepack_linears(self)
        is_last = self.pp_stage is None or self.pp_stage.is_last
        if is_last and self.lm_head is None and self.quant_head is None and self.tp_head is None:
            self.packed_tied_head = tiled.get("head") or PackedLinear(
                self.model.embed_tokens.weight, None)
            n += "head" not in tiled
        if tiled:
            logger.info("%d linear weights run on the small-batch path's packed copy "
                        "(register-tile GEMM, no oneDNN copy)", len(tiled))
        return n

    def resident_tensors(self) -> list[torch.Tensor]:
        """Weight copies held outside the modules (the small-batch path's)."""
        return self.small_batch.resident_tensors()
