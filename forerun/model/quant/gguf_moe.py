"""quantization="gguf" for mixture-of-experts layers: each expert's projections computed in
the file's own blocks.

A GGUF stacks a layer's experts (``ffn_{gate,up,down}_exps``: every expert's rows one after
another), so expert ``e`` of a projection with ``n`` rows per expert is rows
``e * n .. (e + 1) * n`` of the stacked tensor: each expert becomes a
:class:`~forerun.model.quant.gguf_linear.GGUFLinear` over its own rows (gate and up as the two
parts of one fused linear, whatever their types: gpt-oss's are MXFP4), and the layer's
stacked float weights are never allocated.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from forerun.model.moe import FusedMoE
from forerun.model.quant.gguf_linear import GGUFLinear

logger = logging.getLogger(__name__)


def apply_gguf_experts(model: nn.Module, blocks: dict[str, tuple[int, torch.Tensor]]
                       ) -> set[str]:
    """Give every MoE layer whose three stacked expert tensors are in ``blocks``
    (``hf_name -> (type, rows)``) block-backed experts; returns the names consumed."""
    used: set[str] = set()
    for path, moe in model.named_modules():
        if not isinstance(moe, FusedMoE) or moe.w13 is None:
            continue
        names = [f"{path}.experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        if not all(n in blocks for n in names):
            continue
        (tg, gate), (tu, up), (td, down) = (blocks[n] for n in names)
        e, inter = moe.num_experts, moe.intermediate_size
        hidden = moe.w13.shape[2]
        if gate.shape[0] != e * inter or up.shape[0] != e * inter or down.shape[0] != e * hidden:
            continue
        experts = []
        for i in range(e):
            rows = slice(i * inter, (i + 1) * inter)
            gate_up = GGUFLinear([(tg, gate[rows].contiguous()), (tu, up[rows].contiguous())],
                                 hidden)
            out = GGUFLinear([(td, down[i * hidden:(i + 1) * hidden].contiguous())], inter)
            experts.append((gate_up, out))
        moe.use_quantized_experts(experts)
        used.update(names)
    if used:
        logger.info("quantization=gguf: the experts of %d MoE layers run in their blocks",
                    len(used) // 3)
    return used
