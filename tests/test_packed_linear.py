"""Pre-reordered (oneDNN) linear weights give bit-identical bf16 results to ``F.linear``."""

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


def test_prepack_is_not_offered_for_float32_or_other_devices() -> None:
    # float32 keeps the plain path: its results must stay comparable to transformers.
    assert not prepack_supported(torch.float32, CPU)
    assert not prepack_supported(torch.bfloat16, torch.device("meta"))
