"""Quantized weights (``quantization=`` at load): the block formats and their matmuls.

- ``None``: the exact path, weights dequantized to the model's dtype.
- ``"gguf"``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL / MXFP4 blocks
  (:mod:`.gguf_blocks`) and
  K-quant Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS super-blocks (:mod:`.kquant_blocks`)
  stay in memory as they are in the file and the linear layers (and a tied output head)
  compute with them
  (:mod:`forerun.model.quant.gguf_linear`); other tensor types load dequantized, and the log
  names them.
- ``"int8"``: linear weights quantized at load to int8 per output channel, activations per
  token at run time, int8 x int8 -> int32 GEMMs (:mod:`forerun.model.quant.int8_linear`).

The model code calls every linear the same way (``module(x)``); only the modules differ.
"""

from __future__ import annotations

import torch
from torch import nn

QUANTIZATION_METHODS: tuple[str, ...] = ("gguf", "int8")


def validate_quantization(value: str | None) -> str | None:
    """``value`` normalised (lower case), or ``ValueError`` naming the ``quantization`` field."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}; "
            f"got {value!r}")
    return value.lower()


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the model holds: parameters, buffers, quantized blocks and the
    packed copies (oneDNN-reordered linears, the small-batch path's copies), each storage
    counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN) tensors: no storage
            key = id(t)
        if key in seen:
            return
        seen.add(key)
        try:
            total += t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            total += _tensor_bytes(t)

    for t in model.parameters():
        add(t)
    for t in model.buffers():
        add(t)
    for module in model.modules():
        weights = getattr(module, "resident_tensors", None)
        if callable(weights):
            for t in weights():
                add(t)
    return total
