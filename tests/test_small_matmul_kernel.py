"""The small-batch matmul kernel (``csrc/small_matmul.c``) against float64 arithmetic.

The kernel accumulates in float32 and rounds once to the storage type, so the bound is the
float32 summation error for float32 and one bfloat16 rounding of the result for bfloat16.
Shapes cover every register-blocked row count of x (one to eight, and the many-row tiles past eight), output
columns past a multiple of the block (four for float32, sixteen for bfloat16's packed
layout), and float32's k with a tail.
"""

from __future__ import annotations

import pytest
import torch

from forerun.model import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler: the kernels cannot be built"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(64, 576), (67, 576), (40, 100), (3, 34)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_matmul_matches_float64(dtype: torch.dtype, m: int, n: int, k: int,
                                      with_bias: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = cpu_kernels.small_matmul(x, cpu_kernels.pack_small_matmul_weight(w), b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.double() - ref).abs()
    scale = ref.abs() + 1.0
    bound = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: half an ulp is 2**-9 of |y|
    assert (err / scale).max().item() < bound


@pytest.mark.parametrize("m", [9, 12, 13, 25, 64, 128, 300])
@pytest.mark.parametrize(("n", "k"), [(64, 1536), (48, 600), (67, 96), (32, 98), (16, 2)])
def test_many_row_bfloat16_tiles_match_float64(m: int, n: int, k: int) -> None:
    # Past eight rows bfloat16 runs register tiles of 8 rows x three column blocks over
    # chunks of k, on x copied into row tiles (csrc/small_matmul.c): row counts of whole and
    # partial tiles, groups of three, two and one blocks and a padded last block, k in
    # several chunks with a partial one, an odd number of column pairs, a single pair.
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    got = cpu_kernels.small_matmul(x, cpu_kernels.pack_small_matmul_weight(w), b)
    ref = x.double() @ w.double().T + b.double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert ((got.double() - ref).abs() / (ref.abs() + 1.0)).max().item() < 8e-3


def test_small_matmul_keeps_leading_dimensions() -> None:
    x = torch.randn(2, 1, 64)
    w = torch.randn(10, 64)
    torch.testing.assert_close(
        cpu_kernels.small_matmul(x, cpu_kernels.pack_small_matmul_weight(w), None), x @ w.T)


def test_bfloat16_packing_needs_an_even_inner_dimension() -> None:
    with pytest.raises(ValueError, match="even inner dimension"):
        cpu_kernels.pack_small_matmul_weight(torch.zeros(4, 33, dtype=torch.bfloat16))


def _small_matmul_amx(x: torch.Tensor, w: cpu_kernels.SmallMatmulWeight,
                      b: torch.Tensor | None) -> torch.Tensor:
    """The AMX body alone (an error where it cannot run), not the dispatching entry."""
    return cpu_kernels._small_matmul_call("small_matmul_amx", x, w, b)


needs_amx = pytest.mark.skipif(not cpu_kernels.small_matmul_has_amx(),
                               reason="the CPU (or kernel) grants no AMX tiles")


@needs_amx
@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(64, 576), (48, 64), (67, 96), (16, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_small_matmul_matches_float64(m: int, n: int, k: int, with_bias: bool) -> None:
    # Row counts one tile, a partial tile, two tiles and several passes of two; column
    # blocks in pairs, an odd block out, and a padded last block.
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    got = _small_matmul_amx(x, cpu_kernels.pack_small_matmul_weight(w), b)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert ((got.double() - ref).abs() / (ref.abs() + 1.0)).max().item() < 8e-3


@needs_amx
def test_amx_small_matmul_needs_k_a_multiple_of_32() -> None:
    w = cpu_kernels.pack_small_matmul_weight(torch.ones(16, 34, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="AMX"):
        _small_matmul_amx(torch.ones(16, 34, dtype=torch.bfloat16), w, None)
