"""The fused C elementwise kernels against the torch layers they replace.

Oracles: the torch path of the same module (``RMSNorm._forward_torch``, ``F.silu``,
``F.gelu(approximate="tanh")``, the
``rotate_half`` formula), computed in float64 from the same inputs, so both the kernel and
the torch path are measured against exact arithmetic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forerun.model import cpu_kernels
from forerun.model.layers import GatedMLP, RMSNorm
from forerun.model.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler: the kernels cannot be built"
)
DTYPES = [torch.float32, torch.bfloat16]
# float32: summation order only; bfloat16: the one or two roundings of the result.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rms_norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_matches_exact_norm_and_leaves_input_alone(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.copy_(torch.randn(96, generator=gen))
    x = torch.randn(7, 96, generator=gen).to(dtype)
    before = x.clone()
    out = norm(x)
    assert torch.equal(x, before)
    want = _rms_norm_f64(x, norm.weight, 1e-5)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(norm._forward_torch(x).double(), want, atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 72])  # bf16: the 16-wide body, and the general one
def test_fused_residual_norm_returns_sum_and_its_norm(dtype: torch.dtype, dim: int) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(dim, 1e-6).to(dtype)
    norm.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
    x = torch.randn(5, dim, generator=gen).to(dtype)
    residual = torch.randn(5, dim, generator=gen).to(dtype)
    total = x + residual  # the sum rounded to dtype, as the model's residual stream holds it
    out, new_residual = norm.forward_with_residual(x.clone(), residual.clone())
    assert torch.equal(new_residual, total)
    torch.testing.assert_close(out.double(), _rms_norm_f64(total, norm.weight, 1e-6),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 48])  # bf16: the general body, and the 16-wide one
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul_kernel_matches_gated_mlp_formula(dtype: torch.dtype, d: int,
                                                      act: str) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(9, 2 * d, generator=gen) * 4).to(dtype)
    # Far tails, where the GELU's exponent would overflow: exactly 0 below, x above.
    gate_up[0, :4] = torch.tensor([-1e4, -30.0, 30.0, 1e4])
    torch_act = F.silu if act == "silu" else lambda g: F.gelu(g, approximate="tanh")
    kernel = cpu_kernels.silu_and_mul if act == "silu" else cpu_kernels.gelu_tanh_and_mul
    g, u = gate_up.double().split(d, dim=-1)
    want = torch_act(g) * u
    got = kernel(gate_up)
    assert got.shape == (9, d) and got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    mlp = GatedMLP(16, 40, act).to(dtype)  # the module uses the kernel on this path
    x = torch.randn(3, 16, generator=gen).to(dtype)
    gu = mlp.gate_up_proj(x)
    torch.testing.assert_close(mlp(x), mlp.down_proj(torch_act(gu[:, :40]) * gu[:, 40:]),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_kernel_rotates_strided_heads_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    heads, d = 3, 32
    rope = RotaryEmbedding(d, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 100, 4095])
    tables = rope.tables(positions)
    # A q-like view into a wider fused row, as the model's qkv split produces.
    fused = torch.randn(5, heads * d + 24, generator=gen).to(dtype)
    view = fused[:, : heads * d].view(5, heads, d)
    original = view.double().clone()
    tail = fused[:, heads * d:].clone()
    out = apply_rotary(view, tables)
    cos = torch.cat((tables.cos_half, tables.cos_half), -1).double()[:, None, :]
    sin = torch.cat((tables.sin_half, tables.sin_half), -1).double()[:, None, :]
    rotated = torch.cat((-original[..., d // 2:], original[..., : d // 2]), dim=-1)
    want = original * cos + rotated * sin
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    assert out.data_ptr() == view.data_ptr()  # in place
    assert torch.equal(fused[:, heads * d:], tail)  # the rest of the row untouched


def test_argmax_kernel_returns_torchs_first_maximum() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 1000, generator=gen)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first index wins, as in torch
    x[2] = 0.0  # all equal
    x[3, -1] = 80.0  # maximum in the last column
    x[4] = -torch.arange(1000, dtype=torch.float32)  # maximum in the first column
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))
    assert cpu_kernels.argmax_rows(x).tolist() == [int(x[0].argmax()), 17, 0, 999, 0,
                                                   int(x[5].argmax())]


def test_loading_the_kernels_leaves_subnormal_floats_alone() -> None:
    # A library linked with -ffast-math turns on flush-to-zero for the whole process when
    # it loads; numbers every other library computes would silently change.
    cpu_kernels.kernel_library()
    tiny = 2.2250738585072014e-308  # the smallest normal double
    assert tiny / 4 != 0.0
    assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0
    subnormal = torch.tensor([1e-39], dtype=torch.float32) * torch.tensor([0.5])
    assert subnormal.item() != 0.0
