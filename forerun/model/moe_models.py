"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, the Llama-family decoder with a
:class:`~forerun.model.moe.FusedMoE` MLP in their sparse layers.

Checkpoints hold each expert's projections separately (``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` in Qwen3-MoE; ``block_sparse_moe.experts.{e}.w1`` / ``w3`` /
``w2`` in Mixtral) or already stacked (``mlp.experts.gate_up_proj`` / ``down_proj``); both
load into the stacked ``w13`` / ``w2``.
"""

from __future__ import annotations

import re

from torch import nn

from forerun.model.base import WeightSlot
from forerun.model.layers import GatedMLP
from forerun.model.llama import LlamaForCausalLM
from forerun.model.moe import FusedMoE

# Checkpoint projection name -> (stacked parameter, which half of w13: 0 gate, 1 up; None: w2)
_EXPERT_PROJ: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
    "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None),
}
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")
# Every expert at once: transformers' stacked names (gate and up fused), and a GGUF's
# ffn_{gate,up,down}_exps (forerun/model/gguf_file.py names them so).
_STACKED = {"experts.gate_up_proj": "w13", "experts.down_proj": "w2"}
_STACKED_HALVES = {"experts.gate_proj.weight": 0, "experts.up_proj.weight": 1}


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers' MLP is a mixture of experts."""

    # The checkpoints' name for a layer's MoE block (``mlp`` in Qwen3-MoE).
    moe_block_name = "mlp"

    def make_mlp(self, layer: int) -> nn.Module:
        c = self.config
        if not c.is_moe_layer(layer):
            return GatedMLP(c.hidden_size, c.intermediate_size)
        return FusedMoE(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                        c.num_experts_per_tok, c.norm_topk_prob)

    def weight_slot(self, name: str) -> WeightSlot:
        name = name.replace(f".{self.moe_block_name}.", ".mlp.")
        for key, param in _STACKED.items():
            if name.endswith(f".mlp.{key}"):
                return WeightSlot(name.removesuffix(key) + param)
        if name.endswith(".mlp.experts.down_proj.weight"):
            return WeightSlot(name.removesuffix("experts.down_proj.weight") + "w2")
        for key, half in _STACKED_HALVES.items():
            if name.endswith(f".mlp.{key}"):
                size = self.config.moe_intermediate_size
                return WeightSlot(name.removesuffix(key) + "w13", rows=(half * size, size),
                                  rows_dim=1)
        m = _PER_EXPERT.match(name)
        if m is None or m.group(3) not in _EXPERT_PROJ:
            return super().weight_slot(name)
        param, half = _EXPERT_PROJ[m.group(3)]
        target = f"{m.group(1)}.{param}"
        if half is None:
            return WeightSlot(target, int(m.group(2)))
        size = self.config.moe_intermediate_size
        return WeightSlot(target, int(m.group(2)), (half * size, size))

    def _expert_names(self, block: str, param: str, half: int | None = None) -> set[str]:
        """The per-expert checkpoint names of stacked parameter ``block.param`` (of w13's
        gate or up rows alone with ``half`` 0 or 1)."""
        block = block.removesuffix(".mlp") + f".{self.moe_block_name}"
        mixtral = self.moe_block_name == "block_sparse_moe"
        if param == "w13":
            projs = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
            projs = projs if half is None else projs[half:half + 1]
        else:
            projs = ("w2",) if mixtral else ("down_proj",)
        return {f"{block}.experts.{e}.{p}.weight"
                for e in range(self.config.num_experts) for p in projs}

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name in super().expected_weight_names():
            block, _, param = name.rpartition(".")
            if param in ("w13", "w2") and block.endswith(".mlp"):
                names |= self._expert_names(block, param)
            elif block.endswith(".mlp.gate"):  # the router, under the checkpoints' name
                names.add(name.replace(".mlp.", f".{self.moe_block_name}.", 1))
            else:
                names.add(name)
        return names

    def names_loaded_by(self, name: str) -> set[str]:
        slot = self.weight_slot(name)
        block, _, param = slot.param.rpartition(".")
        if slot.index is None and param in ("w13", "w2") and block.endswith(".mlp"):
            half = None if slot.rows is None else slot.rows[0] // slot.rows[1]
            return self._expert_names(block, param, half)
        if slot.param.endswith(".mlp.gate.weight"):  # the router, as the checkpoints name it
            return {slot.param.replace(".mlp.", f".{self.moe_block_name}.", 1)}
        return {name}


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k norm), top-k softmax routing
    (renormalised with ``norm_topk_prob``), no shared expert."""

    qk_norm = "head"


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's attention, top-k of the softmax over all experts, renormalised."""

    moe_block_name = "block_sparse_moe"
