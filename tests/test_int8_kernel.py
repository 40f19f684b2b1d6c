"""The int8 matmul (csrc/int8_matmul.c): exact integer sums in every body this CPU can run,
against int64 arithmetic, on its tiled weights, and the int8 linear the same through it as
through torch._int_mm."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from forerun.model import cpu_kernels
from forerun.model.quant import int8_linear
from forerun.model.quant.int8_linear import Int8Linear
from tests.kernel_variants import build_variants

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_library() is None,
                                reason="no C kernels here")

# -march -> the CPU flags its body needs (x86-64: the plain C body).
_VARIANTS = {"x86-64": set(), "haswell": {"avx2"}, "skylake-avx512": {"avx512bw", "avx512f"},
             "icelake-server": {"avx512bw", "avx512f", "avx512_vnni"}}
SHAPES = [(1, 7, 33), (1, 64, 2048), (2, 5, 16), (3, 9, 100), (4, 8, 64), (5, 13, 17),
          (64, 67, 256), (64, 4, 31),
          # the tiles' edges: k not whole lines of 4 bytes, n short of a tile, of a pass of 4
          # tiles (64 rows) and past it; rows past a pass of 4
          (1, 9, 64), (6, 10, 127), (7, 12, 129), (8, 17, 576), (1, 5, 1), (8, 3, 63),
          (5, 64, 40), (9, 80, 36), (2, 129, 8), (1, 200, 2)]


@pytest.fixture(scope="module")
def bodies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ctypes.CDLL | None]:
    """Loaded builds of int8_matmul.c per body this CPU runs; None is the kernel library."""
    return build_variants(tmp_path_factory.mktemp("int8-variants"), _VARIANTS,
                          ("int8_matmul.c",),
                          cpu_kernels.bind_int8_kernels)


def test_each_variant_is_the_body_it_was_built_for(bodies) -> None:
    want = {"x86-64": "c", "haswell": "avx2", "skylake-avx512": "avx2",
            "icelake-server": "avx512vnni"}
    for name, lib in bodies.items():
        if lib is not None:
            assert cpu_kernels.int8_matmul_isa(lib) == want[name]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_integer_sums_are_exact_in_every_body(bodies, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    # The extremes included: -127 and 127 products summed over the whole row.
    xq = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    xq[0, :] = 127
    wq[0, :] = -127
    oracle = xq.long() @ wq.long().t()
    wsum = cpu_kernels.int8_weight_sums(wq)
    assert torch.equal(wsum[:n].long(), wq.long().sum(dim=1))
    assert not wsum[n:].any()
    tiles = cpu_kernels.int8_tile_weights(wq)
    assert torch.equal(cpu_kernels.int8_tiles_to_rows(tiles, n, k), wq)
    for name, lib in bodies.items():
        # the VNNI body's unsigned x + 128 with 128 * sum(w) off again, the others' signed
        # products: the same sums
        got = cpu_kernels.int8_matmul_acc(xq, tiles, wsum, n, lib=lib)
        assert torch.equal(got.long(), oracle), name


def test_tile_layout_puts_four_bytes_of_sixteen_rows_in_each_line() -> None:
    n, k = 20, 10
    wq = (torch.arange(n * k) % 251 - 125).to(torch.int8).reshape(n, k)
    tiles = cpu_kernels.int8_tile_weights(wq)
    assert tiles.shape == (2, 3, 16, 4)  # ceil(20 / 16) tiles, k rounded up to 12 bytes
    for g, j, r, b in [(0, 0, 0, 0), (0, 2, 15, 1), (1, 1, 3, 3), (0, 1, 7, 2)]:
        assert tiles[g, j, r, b] == wq[16 * g + r, 4 * j + b]
    assert not tiles[1, :, 4:].any() and not tiles[:, 2, :, 2:].any()  # padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", range(1, 9))
def test_int8_linear_against_float64(dtype: torch.dtype, m: int) -> None:
    """Int8Linear (the VNNI body where there is one) against its definition in float64:
    the rows and weights quantized per row, summed and rescaled, for 1..8 rows and odd
    sizes (n not whole blocks of 4 rows, k not whole 64-byte lines)."""
    g = torch.Generator().manual_seed(100 + m)
    n, k = 37, 203
    w = torch.randn(n, k, generator=g)
    lin = Int8Linear(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    got = lin(x)
    xq, sx = cpu_kernels.int8_quantize_rows(x.contiguous())
    want = (xq.double() @ lin.weight_rows().double().t()) * sx.double()[:, None] \
        * lin.weight_scale.double()[None, :]
    # float32: the kernel's float32 rescale against float64's (a few ulps); bfloat16: one
    # rounding step of the output either way
    rtol = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-6)
    # and near the float product itself (the quantization's own error)
    err = (got.double() - x.double() @ w.double().t()).abs().max()
    assert err < 0.05 * (x.double() @ w.double().t()).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int8_linear_is_the_same_through_the_kernel_and_int_mm(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 160, generator=g)
    bias = torch.nn.Parameter(torch.randn(96, generator=g).to(dtype), requires_grad=False)
    lin = Int8Linear(w, bias)
    x = torch.randn(m, 160, generator=g).to(dtype)
    monkeypatch.setattr(int8_linear, "_own_kernel_for", lambda rows: True)
    ours = lin(x)
    monkeypatch.setattr(int8_linear, "_own_kernel_for", lambda rows: False)
    onednn = lin(x)
    torch.testing.assert_close(ours, onednn, rtol=0, atol=0)


def test_the_avx512_body_compiles(tmp_path: Path) -> None:
    """Where this CPU cannot run it, the AVX-512 body is at least built (not run)."""
    from forerun import envs

    flags = [f if f != "-march=native" else "-march=skylake-avx512"
             for f in cpu_kernels._FLAGS]
    src = cpu_kernels._CSRC / "int8_matmul.c"
    try:
        cpu_kernels._run([envs.c_compiler(), *flags, "-c", str(src), "-o",
                          str(tmp_path / "int8.o")])
    except RuntimeError as exc:
        if "skylake-avx512" in str(exc) and "march" in str(exc):
            pytest.skip("the compiler does not know -march=skylake-avx512")
        raise
    assert (tmp_path / "int8.o").stat().st_size > 0
