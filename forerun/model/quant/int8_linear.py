"""``quantization="int8"``: int8 weights per output channel, int8 activations per token.

At load every decoder-layer linear weight ``W`` ``[n, k]`` becomes ``q = round(W / s_w)``
with ``s_w = max|W[j, :]| / 127`` per output row ``j`` (from whatever the checkpoint holds:
a Hugging Face folder's floats, or a GGUF's dequantized values). At run time each token's
activation row gets its own scale the same way (dynamic, symmetric), the product is an
int8 x int8 -> int32 GEMM (``csrc/int8_matmul.c`` on the weights regrouped into tiles of 16
rows at load, at every row count; with AMX, ``torch._int_mm`` past 32 rows: oneDNN's
AMX-INT8 kernels), and the result is scaled back
by ``s_x[i] * s_w[j]`` (``csrc/quant_matmul.c`` fuses the quantize and the rescale, each one
pass over memory). A mixture-of-experts layer's experts become int8 the same way, each
expert's gate/up and down rows per output channel; its router stays in the model's dtype.
Everything else (embedding, output head, norms, attention, and the fused
q/k/v projection: see :data:`KEEP_FLOAT`) stays in the model's dtype: batches are bound by
the GEMMs' arithmetic, which is where int8 pays.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from forerun.model import cpu_kernels
from forerun.model.moe import FusedMoE

_workspace = threading.local()


def _int32_workspace(m: int, n: int) -> torch.Tensor:
    """A per-thread int32 ``[m, n]`` buffer for the GEMM's accumulators, reused across calls:
    a fresh multi-megabyte tensor per call costs its page faults every time (measured: a
    quarter of the rescale pass's time at 512 x 3072). The rescale consumes it before the
    next linear runs on the same thread."""
    buf = getattr(_workspace, "buf", None)
    if buf is None or buf.numel() < m * n:
        # Outside inference mode: a buffer made inside it could not be written by a later
        # call outside it (in-place updates to inference tensors are refused).
        with torch.inference_mode(False):
            buf = torch.empty(m * n, dtype=torch.int32)
        _workspace.buf = buf
    return buf[: m * n].view(m, n)


# Rows up to which csrc/int8_matmul.c runs where oneDNN's int8 GEMM has AMX: past them
# ``torch._int_mm`` (AMX-INT8 tiles) on rows untiled per call. Everywhere else the C kernel
# takes every row count: with AVX512-VNNI it beat ``_int_mm`` at 32 rows by 1.5-2.6x and at
# 512 rows by 0.9-1.2x (the 1B shape's linears, csrc/int8_matmul.c); without VNNI oneDNN's
# int8 path is slower still. The AMX bound is an estimate, not a measurement: untiling is a
# pass over the weights (at 32 rows about what AMX saves over the VNNI tiles), which more
# rows share.
OWN_KERNEL_MAX_ROWS = 32
_onednn_int8_amx: bool | None = None


def _own_kernel_for(rows: int) -> bool:
    global _onednn_int8_amx
    if _onednn_int8_amx is None:
        _onednn_int8_amx = "AMX" in torch.backends.cpu.get_cpu_capability()
    return rows <= OWN_KERNEL_MAX_ROWS or not _onednn_int8_amx


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int8 [n, k], s float32 [n])`` with ``weight ~ q * s[:, None]`` per row."""
    w = weight.detach().float()
    s = w.abs().amax(dim=1) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` int8 per output channel and ``x`` quantized per row."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, s = quantize_weight_int8(weight)
        # The one copy of the int8 weights, in csrc/int8_matmul.c's tiles
        # (cpu_kernels.int8_tile_weights); weight_rows() gives them back as [n, k] rows.
        self.weight_q = cpu_kernels.int8_tile_weights(q)
        self.weight_scale = s
        # Each row's sum: the AVX512-VNNI body multiplies unsigned activations (x + 128) and
        # takes 128 * this off again (csrc/int8_matmul.c).
        self.weight_sum = cpu_kernels.int8_weight_sums(q)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if x.device.type != "cpu":
            # torch._int_mm's GPU kernels refuse small row counts (decode): there the int8
            # weights are dequantized per call (weight-only int8).
            w = (self.weight_rows().to(torch.float32) * self.weight_scale[:, None]).to(x.dtype)
            y = torch.nn.functional.linear(flat, w, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        kernels = cpu_kernels.supports(x.dtype, x.device) and (
            self.bias is None or self.bias.dtype == x.dtype)
        if kernels:
            xq, sx = cpu_kernels.int8_quantize_rows(flat.contiguous())
        else:
            xf = flat.float()
            sx = xf.abs().amax(dim=1) / 127.0
            inv = torch.where(sx > 0, 1.0 / sx, torch.zeros_like(sx))
            xq = torch.round(xf * inv[:, None]).to(torch.int8)
        if kernels and _own_kernel_for(xq.shape[0]):
            acc = cpu_kernels.int8_matmul_acc(
                xq, self.weight_q, self.weight_sum, self.out_features,
                _int32_workspace(xq.shape[0], self.out_features))
        elif kernels:
            acc = torch._int_mm(xq, self.weight_rows().t(),
                                out=_int32_workspace(xq.shape[0], self.out_features))
        else:
            acc = torch._int_mm(xq, self.weight_rows().t())
        if kernels:
            y = cpu_kernels.int8_dequant(acc, sx, self.weight_scale, self.bias, x.dtype)
        else:
            yf = acc.float() * sx[:, None] * self.weight_scale[None, :]
            if self.bias is not None:
                yf = yf + self.bias.float()
            y = yf.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_rows(self) -> torch.Tensor:
        """The int8 weights as ``[out_features, in_features]`` rows (a new tensor)."""
        return cpu_kernels.int8_tiles_to_rows(self.weight_q, self.out_features, self.in_features)

    def resident_tensors(self) -> list[torch.Tensor]:
        """int8 tiles, scales and row sums (for
        :func:`forerun.model.quant.resident_weight_bytes`)."""
        return [self.weight_q, self.weight_scale, self.weight_sum]

    def relocate(self, tensors: list[torch.Tensor]) -> None:
        """Take copies of :meth:`resident_tensors` (in that order; the small-batch path moves
        them into huge pages)."""
        self.weight_q, self.weight_scale, self.weight_sum = tensors

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


# Linears left in the model's dtype. The fused q/k/v reads the normed residual stream, where
# a handful of channels (the same ones in every layer) hold the row's maximum in every token
# of SmolLM2: a per-token int8 scale set by them leaves the other channels two or three
# levels, and that one projection moved the teacher-forced NLL 2.6% off the exact path
# (all four int8: +2.7%; o, gate/up and down int8 with q/k/v in bf16: -0.05%). It is 16% of
# a layer's multiply-adds.
KEEP_FLOAT: frozenset[str] = frozenset({"qkv_proj"})


def int8_experts(moe: FusedMoE) -> list[tuple[Int8Linear, Int8Linear]]:
    """Each expert of a mixture-of-experts layer as ``(gate_up, down)`` :class:`Int8Linear`
    pairs quantized from its stacked float weights (per expert and output channel; the
    expert biases, gpt-oss's, stay on the layer)."""
    return [(Int8Linear(w13), Int8Linear(w2)) for w13, w2 in zip(moe.w13, moe.w2, strict=True)]


def apply_int8(model: nn.Module) -> int:
    """Replace the ``nn.Linear`` modules inside the decoder layers (``model.model.layers``)
    by :class:`Int8Linear` of their weights, except those named in :data:`KEEP_FLOAT`, and
    give every mixture-of-experts layer int8 experts (:func:`int8_experts`); returns the
    count of linears (two per expert). The output head and the MoE routers are left alone:
    a router's logits choose the experts, and rounding them would change the choice."""
    count = 0
    layers = model.get_submodule("model.layers")
    modules = list(layers.named_modules())
    moe_paths = {path for path, module in modules if isinstance(module, FusedMoE)}
    for path, module in modules:
        if path in moe_paths and module.w13 is not None:
            experts = int8_experts(module)
            module.use_quantized_experts(experts)
            count += 2 * len(experts)
        elif (isinstance(module, nn.Linear) and path.rpartition(".")[2] not in KEEP_FLOAT
              and path.rpartition(".")[0] not in moe_paths):
            parent, _, leaf = path.rpartition(".")
            setattr(layers.get_submodule(parent) if parent else layers, leaf,
                    Int8Linear(module.weight, module.bias))
            count += 1
    return count
