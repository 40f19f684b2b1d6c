"""Quantized-weight kernels (forerun/model/csrc/quant_matmul.c and the torch fallback)
against float64 oracles that dequantize the same blocks with the ``gguf`` package: Q8_0, Q4_0,
Q4_1, and Q5_0, Q5_1 and IQ4_NL (the 32-value types llama.cpp writes in K-quant files for
rows that are not a multiple of 256 values).

Every instruction-set body this machine can run is built on its own (``-march=...``) and
checked, besides the kernel library's native build and the pure-torch fallback.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize

from forerun.model import cpu_kernels
from forerun.model.quant import resident_weight_bytes, validate_quantization
from forerun.model.quant.gguf_blocks import dequantize_rows, gguf_matmul_torch
from forerun.model.quant.gguf_linear import GGUFEmbedding, GGUFLinear
from forerun.model.quant.int8_linear import Int8Linear, quantize_weight_int8
from tests.kernel_variants import cpu_flags
from tests.kquant_pack import pack_blocks

QTYPES = [GT.Q8_0, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.IQ4_NL]
# (m rows of x, n outputs, k inputs): batch 1 and 64, odd n, k one block and many.
SHAPES = [(1, 37, 32), (1, 96, 576), (3, 17, 160), (64, 45, 96), (64, 8, 1536)]


def _linear(qtype: GT, n: int, k: int, seed: int) -> tuple[GGUFLinear, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = pack_blocks(w, qtype)
    return GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k), \
        dequantize(raw, qtype).astype(np.float64)


def _act_oracle(x: np.ndarray) -> np.ndarray:
    """x after the activation quantization the kernels use, computed in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    s = np.abs(xb).max(axis=-1, keepdims=True) / 127.0
    q = np.round(np.divide(xb, s, out=np.zeros_like(xb), where=s > 0))
    return (q * s).reshape(m, k)


def _check(y: torch.Tensor, x: torch.Tensor, wd: np.ndarray, bias: np.ndarray | None = None
           ) -> None:
    xd = x.double().numpy()
    exact = xd @ wd.T + (0 if bias is None else bias)
    oracle = _act_oracle(xd) @ wd.T + (0 if bias is None else bias)
    got = y.double().numpy()
    scale = np.abs(exact).max()
    # Same function: only float rounding (and a rare activation rounding tie) differ.
    tol = 8e-3 if y.dtype == torch.bfloat16 else 2e-4  # bf16 output: 2^-8 relative
    assert np.abs(got - oracle).max() <= tol * scale
    # And the function is close to the unquantized product (8-bit activations).
    assert np.abs(got - exact).max() <= 3e-2 * scale


def _run(lin: GGUFLinear, x: torch.Tensor, path: str, lib: ctypes.CDLL | None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    if path == "torch":
        return gguf_matmul_torch(x, lin.parts, bias)
    return cpu_kernels.gguf_matmul(x.contiguous(), lin.desc, lin.out_features, bias, lib=lib)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gguf_matmul_matches_float64_oracle(gguf_paths, qtype: GT, shape) -> None:
    m, n, k = shape
    lin, wd = _linear(qtype, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, wd)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_every_row_tail_of_the_many_row_passes(gguf_paths, qtype: GT) -> None:
    """Activation rows run in passes of 4 (8 in the 512-bit body), each count its own
    compiled instance: 2, 4 and 6 rows, and 13 and 15 (a whole pass of 8 then 5 and 7)."""
    lin, wd = _linear(qtype, 19, 96, seed=11)
    x = torch.randn(15, 96, generator=torch.Generator().manual_seed(12))
    for m in (2, 4, 6, 13, 15):
        for path, lib in gguf_paths:
            _check(_run(lin, x[:m], path, lib), x[:m], wd)


def test_every_available_body_was_checked(gguf_variants) -> None:
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler here: only the torch fallback runs")
    isas = {cpu_kernels.quant_matmul_isa(lib) for lib in gguf_variants.values()}
    assert "c" in isas  # the plain-C body runs on any x86-64
    flags = cpu_flags()
    if {"avx2", "fma", "f16c"} <= flags:
        assert "avx2" in isas
    if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags:
        assert "avx512vnni" in isas
    if "avx_vnni" in flags:
        assert "vnni" in isas


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_bias_and_bfloat16(gguf_paths, qtype: GT) -> None:
    lin, wd = _linear(qtype, 40, 96, seed=7)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(4))
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib, bias), x, wd, bias.double().numpy())
        xb, bb = x.bfloat16(), bias.bfloat16()
        y = _run(lin, xb, path, lib, bb)
        assert y.dtype == torch.bfloat16
        _check(y, xb.float(), wd, bb.double().numpy())


def test_fused_parts_of_different_types(gguf_paths) -> None:
    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((n, 64)).astype(np.float32) for n in (24, 8, 9, 5)]
    types = [GT.Q4_1, GT.Q8_0, GT.Q5_0, GT.IQ4_NL]
    raws = [pack_blocks(w, t) for w, t in zip(ws, types, strict=True)]
    lin = GGUFLinear([(int(t), torch.from_numpy(r.copy())) for t, r in
                      zip(types, raws, strict=True)], 64)
    wd = np.concatenate([dequantize(r, t) for r, t in zip(raws, types, strict=True)]
                        ).astype(np.float64)
    for m in (1, 64):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        for path, lib in gguf_paths:
            _check(_run(lin, x, path, lib), x, wd)
    x = torch.randn(2, 3, 64)  # leading dimensions are kept
    assert lin(x).shape == (2, 3, 46)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_the_files_values(qtype: GT) -> None:
    rng = np.random.default_rng(11)
    raw = pack_blocks(rng.standard_normal((30, 96)).astype(np.float32), qtype)
    want = dequantize(raw, qtype)
    got = dequantize_rows(int(qtype), torch.from_numpy(raw.copy()), 96)
    assert np.array_equal(got.numpy(), want)
    table = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 96)
    # The tiles hold the file's bytes: all of them back, and any rows picked out.
    assert np.array_equal(table.parts[0][1].numpy(), raw)
    emb = GGUFEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 0, 29], [3, 3, 17]])
    assert torch.equal(emb(ids), torch.from_numpy(want)[ids])
    # 30 rows held as two tiles of 16 (the last padded with zero blocks).
    assert resident_weight_bytes(emb) == raw.nbytes // 30 * 32


def _random_blocks(qtype: GT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of random bytes (every nibble, every fifth bit) with small fp16 scales (and
    Q5_1's offsets) of either sign."""
    size = {GT.Q5_0: 22, GT.Q5_1: 24, GT.IQ4_NL: 18}[qtype]
    raw = rng.integers(0, 256, size=(n * (k // 32), size), dtype=np.uint8)
    for off in ((0, 2) if qtype == GT.Q5_1 else (0,)):
        raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, (raw.shape[0], 1)).astype(
            np.float16).view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", [GT.Q5_0, GT.Q5_1, GT.IQ4_NL], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 7])
def test_random_bytes_of_the_fallback_types(gguf_paths, qtype: GT, m: int) -> None:
    rng = np.random.default_rng(m + int(qtype))
    raw = _random_blocks(qtype, 35, 160, rng)
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 160)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, wd)


@pytest.mark.parametrize(("qtype", "fill"), [
    (GT.Q5_1, 0xFF),  # every value 31, the largest unsigned u (the maddubs body's int16 sums)
    (GT.Q5_0, 0x00),  # every value 0 - 16
    (GT.IQ4_NL, 0x00),  # every level -127
    (GT.IQ4_NL, 0xFF),  # every level 113
], ids=["Q5_1-31", "Q5_0-minus16", "IQ4_NL-minus127", "IQ4_NL-113"])
def test_largest_values_against_largest_activations_do_not_overflow(gguf_paths, qtype: GT,
                                                                    fill: int) -> None:
    """Activations quantizing to +-127 against the type's largest quants: the AVX2 bodies'
    int16 products and sums at their bounds."""
    raw = _random_blocks(qtype, 20, 512, np.random.default_rng(fill))
    quants = raw.reshape(-1, raw.shape[1] // (512 // 32))
    quants[:, 4 if qtype == GT.Q5_1 else 2:] = fill  # qh and qs (IQ4_NL: qs)
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512)
    x = torch.ones(6, 512)
    x[1::3] = -1.0
    x[2::3, ::2] = -1.0
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, wd)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["c-ends", "torch"])
@pytest.mark.parametrize("m", [1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_float64_oracle(monkeypatch: pytest.MonkeyPatch, use_kernels: bool,
                                            m: int, dtype: torch.dtype) -> None:
    if use_kernels and cpu_kernels.kernel_library() is None:
        pytest.skip("no C kernels here")
    if not use_kernels:
        monkeypatch.setattr(cpu_kernels, "supports", lambda *a: False)
    g = torch.Generator().manual_seed(m)
    w = torch.randn(77, 200, generator=g)
    bias = torch.randn(77, generator=g).to(dtype)
    lin = Int8Linear(w, torch.nn.Parameter(bias, requires_grad=False))
    x = torch.randn(m, 200, generator=g).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, 77)
    # Oracle: per-channel int8 weights and per-row int8 activations, in float64.
    wd = w.double()
    sw = wd.abs().amax(1, keepdim=True) / 127
    wq = torch.round(wd / sw).clamp(-127, 127) * sw
    xd = x.double()
    sx = xd.abs().amax(1, keepdim=True) / 127
    xq = torch.round(xd / sx) * sx
    oracle = xq @ wq.t() + bias.double()
    scale = oracle.abs().max()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    assert (y.double() - oracle).abs().max() <= tol * scale
    assert (y.double() - (xd @ wd.t() + bias.double())).abs().max() <= 3e-2 * scale
    q, s = quantize_weight_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.shape == (77,)


def test_quantization_value_is_validated() -> None:
    assert validate_quantization(None) is None
    assert validate_quantization("GGUF") == "gguf"
    with pytest.raises(ValueError, match="quantization"):
        validate_quantization("fp8")
