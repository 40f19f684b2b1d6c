"""The GGUF matmul's AMX path (forerun/model/csrc/quant_amx.c): many bfloat16 rows against the
weight dequantized to bfloat16 tiles, checked against a float64 oracle built from ``gguf``'s
own dequantization of the same blocks (rounded to bfloat16, as the path holds them).

It runs only on a CPU with AMX; elsewhere these tests skip and the integer bodies (checked in
test_quant_kernels.py and test_kquant_kernels.py) are the whole of the matmul.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from forerun.model import cpu_kernels
from forerun.model.quant.gguf_linear import GGUFLinear
from tests.kernel_variants import cpu_flags
from tests.kquant_pack import pack_kquant, random_kblocks

KQUANTS = [GT.Q4_K, GT.Q5_K, GT.Q6_K]
TYPES = [GT.Q4_0, GT.Q4_1, GT.Q8_0, GT.MXFP4, *KQUANTS]


@pytest.fixture(autouse=True)
def amx_path() -> Iterator[None]:
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags():
        pytest.skip("no AMX-BF16 on this CPU: the integer bodies run every row count")
    if not cpu_kernels.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no C compiler here")
    previous = cpu_kernels.set_gguf_amx(True)
    yield
    cpu_kernels.set_gguf_amx(previous)


def _blocks(qtype: GT, n: int, k: int, rng: np.random.Generator, random_bytes: bool = False
            ) -> np.ndarray:
    if qtype == GT.MXFP4:  # gguf cannot write it: random nibbles, exponents near 2^0
        raw = rng.integers(0, 256, size=(n, k // 32 * 17), dtype=np.uint8)
        raw[:, ::17] = rng.integers(118, 131, size=(n, k // 32), dtype=np.uint8)
        return raw
    if qtype in KQUANTS:
        if random_bytes:
            return random_kblocks(qtype, n, k, rng)
        return pack_kquant(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a.astype(np.float32)).bfloat16().double().numpy()


def _check(y: torch.Tensor, x: torch.Tensor, wd: np.ndarray, bias: torch.Tensor | None) -> None:
    """y within float32 summation error of the float64 product with the bfloat16 weight,
    plus half a bfloat16 step where y is bfloat16 (rounded once, so that is all it may
    differ by)."""
    xd, wb = x.double().numpy(), _bf16(wd)
    exact = xd @ wb.T + (0 if bias is None else bias.double().numpy())
    magnitude = np.abs(xd) @ np.abs(wb).T
    got = y.double().numpy()
    rounding = 2.0 ** -8 if y.dtype == torch.bfloat16 else 0.0
    assert y.dtype in (torch.bfloat16, torch.float32)
    assert np.all(np.abs(got - exact) <= rounding * np.abs(exact) + 1e-5 * magnitude)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(32, 16, 256), (33, 45, 512), (64, 37, 1024),
                                   (100, 96, 768)], ids=lambda s: "x".join(map(str, s)))
def test_amx_path_matches_bfloat16_weight_oracle(qtype: GT, shape: tuple[int, int, int]
                                                 ) -> None:
    m, n, k = shape
    rng = np.random.default_rng(m * 131 + n)
    raw = _blocks(qtype, n, k, rng)
    wd = dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    for b in (None, bias):
        _check(cpu_kernels.gguf_matmul(x, lin.desc, n, b), x, wd, b)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
def test_every_bit_pattern_of_the_k_quant_tiles(qtype: GT) -> None:
    """Random bytes: every scale and min (Q6_K's negative scales among them) and quant bit."""
    rng = np.random.default_rng(3)
    raw = _blocks(qtype, 48, 512, rng, random_bytes=True)
    wd = dequantize(raw, qtype).reshape(48, 512).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    _check(lin(x), x, wd, None)


def test_fused_parts_each_into_their_own_columns() -> None:
    """Parts of different types and odd row counts: a last group of 16 rows that a part fills
    only partly must not write into the next part's columns."""
    rng = np.random.default_rng(9)
    types, rows = [GT.Q4_K, GT.Q6_K, GT.Q5_K], [40, 9, 23]
    raws = [_blocks(t, r, 512, rng) for t, r in zip(types, rows, strict=True)]
    lin = GGUFLinear([(int(t), torch.from_numpy(r.copy())) for t, r in
                      zip(types, raws, strict=True)], 512)
    wd = np.concatenate([dequantize(r, t).reshape(-1, 512) for r, t in
                         zip(raws, types, strict=True)]).astype(np.float64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(37, 512, generator=gen).bfloat16()
    bias = torch.randn(72, generator=gen).bfloat16()
    _check(cpu_kernels.gguf_matmul(x, lin.desc, 72, bias), x, wd, bias)
    # The integer bodies' result differs (their activations are 8-bit): the path above ran.
    cpu_kernels.set_gguf_amx(False)
    integer = cpu_kernels.gguf_matmul(x, lin.desc, 72, bias)
    cpu_kernels.set_gguf_amx(True)
    assert not torch.equal(integer, cpu_kernels.gguf_matmul(x, lin.desc, 72, bias))


@pytest.mark.parametrize("qtype", [GT.Q6_K, GT.Q8_0], ids=lambda t: t.name)
def test_float32_logits_from_bfloat16_rows(qtype: GT) -> None:
    """An output head: bfloat16 hidden rows in, float32 logits (and bias) out, not rounded to
    bfloat16; float32 rows stay on the integer bodies (exact weights)."""
    rng = np.random.default_rng(12)
    raw = _blocks(qtype, 45, 512, rng)
    wd = dequantize(raw, qtype).reshape(45, 512).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 512, generator=gen).bfloat16()
    bias = torch.randn(45, generator=gen)
    for b in (None, bias):
        y = cpu_kernels.gguf_matmul(x, lin.desc, 45, b, out_dtype=torch.float32)
        _check(y, x, wd, b)
    assert lin.logits(x).dtype == torch.float32
    _check(lin.logits(x), x, wd, None)
    cpu_kernels.set_gguf_amx(False)
    integer = lin.logits(x)
    cpu_kernels.set_gguf_amx(True)
    assert not torch.equal(integer, lin.logits(x))  # the AMX path ran above
    assert torch.equal(lin.logits(x.float()), integer)  # float32 rows: the integer bodies


@pytest.mark.parametrize(("m", "n", "k"), [(40, 597, 512), (17, 40, 16640)],
                         ids=["many-pairs-a-panel", "k-in-two-chunks"])
def test_tall_weights_in_panels_and_long_rows_in_chunks(m: int, n: int, k: int) -> None:
    """A thread's panel holds several pairs of 16-row groups (the last panel and group
    partial), and a k too long for one panel's scratch runs in chunks (the last one short)
    whose sums wait in float32 between them."""
    rng = np.random.default_rng(n)
    raw = _blocks(GT.Q4_K, n, k, rng)
    wd = dequantize(raw, GT.Q4_K).reshape(n, k).astype(np.float64)
    lin = GGUFLinear([(int(GT.Q4_K), torch.from_numpy(raw.copy()))], k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    _check(cpu_kernels.gguf_matmul(x, lin.desc, n, bias), x, wd, bias)


@pytest.mark.parametrize(("qtype", "rows"), [(GT.Q4_K, 15), (GT.Q4_0, 31)],
                         ids=["Q4_K-15", "Q4_0-31"])
def test_fewer_rows_than_the_threshold_take_the_integer_bodies(qtype: GT, rows: int) -> None:
    """Below 16 rows (K-quants) or 32 (the 32-value types) the integer bodies are faster and
    run: the results are theirs bit for bit; one row more and they are not."""
    rng = np.random.default_rng(1)
    raw = _blocks(qtype, 32, 256, rng)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 256)
    x = torch.randn(rows + 1, 256, generator=torch.Generator().manual_seed(6)).bfloat16()
    on = [lin(x[:m]) for m in (rows, rows + 1)]
    cpu_kernels.set_gguf_amx(False)
    off = [lin(x[:m]) for m in (rows, rows + 1)]
    assert torch.equal(on[0], off[0])
    assert not torch.equal(on[1], off[1])
