"""Small building blocks shared by the decoder models: RMSNorm and the gated MLP.

On CPU in float32/bfloat16 both run as fused C kernels (forerun/model/cpu_kernels.py)
where those could be built; the torch code below is the same function, used elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.model import cpu_kernels


def _use_kernels(x: torch.Tensor) -> bool:
    return cpu_kernels.supports(x.dtype, x.device)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernels(x) and x.stride(-1) == 1 and x.dtype == self.weight.dtype:
            # A strided x (q/k heads, views of the fused projection) is copied once into
            # the contiguous output, which the kernel then norms in place.
            out = x.clone() if x.is_contiguous() else x.contiguous()
            cpu_kernels.rms_norm_(out, self.weight, self.eps)
            return out
        return self._forward_torch(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; may reuse both inputs' storage."""
        if (_use_kernels(x) and x.is_contiguous() and residual.is_contiguous()
                and x.dtype == residual.dtype == self.weight.dtype):
            cpu_kernels.rms_norm_(x, self.weight, self.eps, residual)
            return x, residual
        residual = x + residual
        return self._forward_torch(residual), residual

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as the reference implementation so float32 matches bitwise
        # closely: normalise in float32, cast back, then scale.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul; ``act`` is
    SiLU (Llama, Qwen, Mistral) or GELU with the tanh approximation (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.intermediate_size = intermediate_size
        self.act = act
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _use_kernels(gate_up):
            fused = (cpu_kernels.silu_and_mul if self.act == "silu"
                     else cpu_kernels.gelu_tanh_and_mul)
            return self.down_proj(fused(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.act == "silu":
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
