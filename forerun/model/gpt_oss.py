"""gpt-oss (``GptOssForCausalLM``): the Llama-family decoder with attention sinks (a learned
logit per query head in every softmax's denominator), q/k/v/o biases, sliding-window
attention on the even layers and full attention on the odd ones (``layer_types``), YaRN
rope, and a mixture of experts in every layer: a biased router whose softmax runs over the
chosen ``top_k`` logits, and experts with biases and the clamped SwiGLU
(:func:`~forerun.model.moe.clamped_swiglu`).

The experts arrive in any of three forms, all loaded into the stacked ``w13`` / ``w2``
(gate rows first, then up: :mod:`forerun.model.moe`) and ``b13`` / ``b2``:

- transformers' floats: ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (input-major, gate and
  up columns interleaved), ``down_proj`` ``[E, I, H]`` and their ``_bias`` tensors;
- OpenAI's MXFP4 checkpoints: ``gate_up_proj_blocks`` ``[E, 2I, H / 32, 16]`` (two FP4
  values a byte, the low nibble first) with ``_scales`` ``[E, 2I, H / 32]`` (E8M0 exponents
  biased by 127), dequantized here as transformers does;
- a GGUF (llama.cpp's converter): ``ffn_{gate,up,down}_exps`` and their biases, gate and up
  already separate (MXFP4 blocks there stay in their blocks with quantization="gguf";
  :mod:`forerun.model.quant.gguf_moe`).

Every name is translated to the model's own in :meth:`GptOssForCausalLM.load_weights`;
missing tensors are reported under transformers' names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from forerun.model.llama import LlamaForCausalLM
from forerun.model.moe import FusedMoE

# transformers' FP4 E2M1 values by nibble (OpenAI's MXFP4 checkpoints).
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The model's MoE parameter -> transformers' checkpoint name (under ``...mlp.``).
_HF_NAMES = {"w13": "experts.gate_up_proj", "b13": "experts.gate_up_proj_bias",
             "w2": "experts.down_proj", "b2": "experts.down_proj_bias",
             "gate.weight": "router.weight", "gate.bias": "router.bias"}


def dequantize_mxfp4_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., rows, G * 32]`` from OpenAI's MXFP4 ``blocks`` ``[..., rows, G, 16]``
    (uint8, value ``2i`` in byte ``i``'s low nibble, ``2i + 1`` in its high one) and
    ``scales`` ``[..., rows, G]`` (each group of 32 times ``2 ** (scale - 127)``)."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)
    vals = vals.reshape(*b.shape[:-1], 32)
    vals = torch.ldexp(vals, scales.to(torch.int32).unsqueeze(-1) - 127)
    return vals.reshape(*b.shape[:-2], -1)


def _gate_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up entries along ``dim`` (gate at even indices) -> gate, then up."""
    x = t.movedim(dim, 0)
    return torch.cat([x[0::2], x[1::2]]).movedim(0, dim).contiguous()


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: see the module docstring. The attention sinks live in each layer's
    ``self_attn.sinks`` (``ModelConfig.attention_sinks``)."""

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        assert c.swiglu_alpha is not None and c.swiglu_limit is not None
        return FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                        c.num_experts_per_tok, True, router_bias=True,
                        softmax_over_top_k=True, expert_bias=True,
                        swiglu=(c.swiglu_alpha, c.swiglu_limit))

    @staticmethod
    def _hf_name(name: str) -> str:
        pre, sep, key = name.partition(".mlp.")
        if sep and key in _HF_NAMES:
            return f"{pre}.mlp.{_HF_NAMES[key]}"
        return name

    def expected_weight_names(self) -> set[str]:
        return {self._hf_name(n) for n in super().expected_weight_names()}

    def names_loaded_by(self, name: str) -> set[str]:
        return {self._hf_name(name)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._own_names(weights))

    def _own_names(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the model's names, in its layouts (see the
        module docstring); pairs that arrive apart (MXFP4 blocks and scales, a GGUF's gate
        and up) are held until both are in."""
        held: dict[str, torch.Tensor] = {}
        for name, t in weights:
            pre, sep, key = name.partition(".mlp.")
            if not sep:
                if name.endswith(".self_attn.sinks.weight"):  # a GGUF's attn_sinks
                    name = name.removesuffix(".weight")
                yield name, t
                continue
            mlp = f"{pre}.mlp."
            if key in ("router.weight", "router.bias"):
                yield mlp + "gate." + key.rpartition(".")[2], t
            elif key == "experts.gate_up_proj":
                yield mlp + "w13", _gate_first(t.transpose(1, 2), 1)
            elif key == "experts.gate_up_proj_bias":
                yield mlp + "b13", _gate_first(t, 1)
            elif key == "experts.down_proj":
                yield mlp + "w2", t.transpose(1, 2).contiguous()
            elif key == "experts.down_proj_bias":
                yield mlp + "b2", t
            elif key.endswith(("_proj_blocks", "_proj_scales")):
                proj = key.rpartition("_")[0]  # experts.gate_up_proj / experts.down_proj
                held[name] = t
                blocks, scales = f"{pre}.mlp.{proj}_blocks", f"{pre}.mlp.{proj}_scales"
                if blocks in held and scales in held:
                    w = dequantize_mxfp4_checkpoint(held.pop(blocks), held.pop(scales))
                    # [E, out, in]: gate_up's rows interleaved, down's already w2's layout.
                    yield (mlp + "w13", _gate_first(w, 1)) if "gate_up" in proj else (
                        mlp + "w2", w)
            elif key.startswith(("experts.gate_proj.", "experts.up_proj.")):
                kind = key.rpartition(".")[2]  # weight or bias
                held[name] = t
                gate, up = (f"{mlp}experts.{p}.{kind}" for p in ("gate_proj", "up_proj"))
                if gate in held and up in held:
                    yield (mlp + ("w13" if kind == "weight" else "b13"),
                           torch.cat([held.pop(gate), held.pop(up)], dim=1))
            elif key == "experts.down_proj.weight":
                yield mlp + "w2", t
            elif key == "experts.down_proj.bias":
                yield mlp + "b2", t
            else:
                yield name, t
