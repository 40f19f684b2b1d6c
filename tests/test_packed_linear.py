"""Pre-reordered (oneDNN) linear weights give bit-identical bf16 results to ``F.linear``, and
float32 results within float32 rounding of a float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from forerun.model.packed_linear import PackedLinear, prepack_linears, prepack_supported

CPU = torch.device("cpu")
needs_prepack = pytest.mark.skipif(not prepack_supported(torch.bfloat16, CPU),
                                   reason="no oneDNN bf16 linear on this CPU")


@needs_prepack
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_equal_to_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, 80, generator=gen).bfloat16()
    assert torch.equal(PackedLinear(w, b)(x), F.linear(x, w, b))


@needs_prepack
def test_packed_linear_keeps_leading_dimensions() -> None:
    w = torch.randn(16, 8).bfloat16()
    x = torch.randn(2, 5, 8).bfloat16()
    out = PackedLinear(w, None)(x)
    assert out.shape == (2, 5, 16)
    assert torch.equal(out, F.linear(x, w))


@needs_prepack
def test_prepack_linears_replaces_every_linear_and_nothing_else() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 4)))
    model = model.bfloat16()
    assert prepack_linears(model) == 2
    kinds = [type(m) for m in model.modules()]
    assert nn.Linear not in kinds and kinds.count(PackedLinear) == 2 and nn.LayerNorm in kinds


@pytest.mark.skipif(not prepack_supported(torch.float32, CPU),
                    reason="no oneDNN float32 linear on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_float32_packed_linear_matches_a_float64_reference(rows: int) -> None:
    # oneDNN sums in its own order, so the oracle is float64, not F.linear's bits; the bound
    # is float32 rounding over 640-term sums, far below any real weight or activation change.
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 640, generator=gen)
    b = torch.randn(200, generator=gen)
    x = torch.randn(rows, 640, generator=gen)
    want = F.linear(x.double(), w.double(), b.double())
    got = PackedLinear(w, b)(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert (got.double() - want).abs().max() <= 4 * (F.linear(x, w, b).double() - want).abs().max()


def test_prepack_is_not_offered_for_other_dtypes_or_devices() -> None:
    assert not prepack_supported(torch.float16, CPU)
    assert not prepack_supported(torch.bfloat16, torch.device("meta"))
    assert not prepack_supported(torch.float32, torch.device("meta"))
    assert not prepack_supported(torch.float32, CPU, quantization="int8")
    assert not prepack_supported(torch.float32, CPU, quantization="gguf")
