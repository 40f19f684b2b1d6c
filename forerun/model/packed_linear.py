"""Linear layers with weights reordered once, at load, into oneDNN's blocked CPU layout.

``F.linear`` on CPU hands the row-major ``[out, in]`` weight to oneDNN, which repacks it into
its blocked layout on every call. For decode-sized inputs (a few to a few dozen rows) that
repacking is a large part of the matmul: measured on the 2-core machine, a pre-reordered
bf16 weight is 1.1-1.2x faster at 64 rows and 1.5-1.8x faster at 1-7 rows, the shapes of
low-concurrency serving. The reorder costs memory only while loading (the plain weight is
dropped afterwards) and changes no result in bf16. float32 weights are reordered too: there
oneDNN's blocked kernels sum in another order than the plain ``F.linear`` (results differ in
the last bits, as the small-batch kernel's do), and on a CPU without AVX-512, where float32
is the default dtype, they are 1.2-2.7x faster at 8-128 rows (the README's benchmark notes
the CPU). (The small-batch path keeps a copy of its own, packed for its kernel:
``forerun/model/small_batch.py``. In bfloat16 on a CPU with AVX512-BF16 and no AMX that copy
serves every step: :class:`TileLinear` runs the small matmul's register-tile GEMM on it, as
fast as oneDNN's from 32 rows on, and no reordered copy is made.)
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from forerun import envs
from forerun.model import cpu_kernels

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any row count works with it.
_PACK_HINT_ROWS = 64


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_HINT_ROWS)


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` kept only in oneDNN's pre-reordered form."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters or buffers: the opaque oneDNN tensor must not be
        # moved, cast or saved by nn.Module machinery.
        self.packed_weight = _reorder(weight)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_matmul(x, self.packed_weight, self.bias, self.out_features)

    def resident_tensors(self) -> list[torch.Tensor]:
        """The reordered weight and the bias (for resident-memory reports)."""
        return [self.packed_weight] + ([] if self.bias is None else [self.bias])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class TileLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` the small-batch path's packed copy, shared with it.

    Holds the :class:`~forerun.model.cpu_kernels.SmallMatmulWeight` itself, not its tensor:
    the small-batch path may move that tensor (into huge pages) after this is made.
    """

    def __init__(self, weight: cpu_kernels.SmallMatmulWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.n, weight.k
        self.tiled_weight = weight  # a plain attribute: shared, not this module's to move
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.small_matmul(x.contiguous(), self.tiled_weight, self.bias)

    def resident_tensors(self) -> list[torch.Tensor]:
        """The bias (the weight is the small-batch path's, counted there)."""
        return [] if self.bias is None else [self.bias]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiled"


def prepack_supported(dtype: torch.dtype, device: torch.device,
                      quantization: str | None = None) -> bool:
    """True where pre-reordered linears are available and give the plain linear's result
    (bfloat16: bit for bit; float32: to within float32 rounding, and only on the exact path:
    with ``quantization="int8"`` the per-token rounding of the int8 linears' inputs turns
    last-bit differences of the float q/k/v into another rounding pattern (SmolLM2's
    teacher-forced NLL -0.29% -> -1.03% off the exact path), and the GGUF modes have no
    float linears to speak of)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if dtype == torch.float32 and quantization is not None:
        return False
    if not envs.cpu_prepack_enabled():
        logger.info("FORERUN_CPU_PREPACK=0: linear weights stay in their plain layout")
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        got = _packed_matmul(x, _reorder(w), None, 48)
        want = torch.nn.functional.linear(x, w)
        ok = (torch.equal(got, want) if dtype == torch.bfloat16
              else torch.allclose(got, want, rtol=1e-5, atol=1e-6))
    except (RuntimeError, AttributeError) as exc:  # op missing or CPU lacks bf16 support
        logger.info("pre-reordered linears unavailable (%s)", exc)
        return False
    if not ok:
        logger.info("pre-reordered linears disagree with F.linear here; not used")
    return ok


def prepack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear`, except those a
    module names in its ``unpacked_linears`` (read as plain rows elsewhere); returns the count."""
    count = 0
    keep = getattr(module, "unpacked_linears", ())
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and name not in keep:
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        elif not isinstance(child, nn.Linear):
            count += prepack_linears(child)
    return count
