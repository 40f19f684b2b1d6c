"""K-quant kernels (the tiles of forerun/model/csrc/quant_matmul.c, and the torch fallback)
against float64 oracles that dequantize the same blocks with the ``gguf`` package.

The blocks come from the tests' own packer (tests/kquant_pack.py: ``gguf`` cannot write
K-quants) and from random bytes (every bit pattern); the oracle never uses the packer's
idea of the format, only ``gguf.quants.dequantize``. Every instruction-set body this machine
can run is built on its own (``-march=...``) and checked, besides the kernel library's native
build and the pure-torch fallback.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize

from forerun.model import cpu_kernels
from forerun.model.quant import resident_weight_bytes
from forerun.model.quant.gguf_linear import GGUFEmbedding, GGUFLinear
from forerun.model.quant.kquant_blocks import dequantize_krows, kquant_matmul_torch
from tests.kernel_variants import build_quant_variant
from tests.kquant_pack import _HALF_OFFSETS, BLOCK_BYTES, pack_kquant, random_kblocks

KTYPES = [GT.Q4_K, GT.Q6_K, GT.Q5_K, GT.Q3_K, GT.Q2_K, GT.IQ4_XS]
# (m rows of x, n outputs, k inputs): batch 1 and 64, odd n and m, k one super-block and many.
SHAPES = [(1, 37, 256), (1, 96, 1024), (3, 17, 768), (5, 1, 512), (64, 45, 256),
          (64, 8, 1536)]


def _weights(qtype: GT, n: int, k: int, seed: int, random_bytes: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if random_bytes:
        return random_kblocks(qtype, n, k, rng)
    return pack_kquant(rng.standard_normal((n, k)).astype(np.float32), qtype)


def _act_oracle(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x after the activation quantization the kernels use (per ``block`` values, one scale
    max|x| / 127, round half to even), in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    s = np.abs(xb).max(axis=-1, keepdims=True) / 127.0
    q = np.round(np.divide(xb, s, out=np.zeros_like(xb), where=s > 0))
    return (q * s).reshape(m, k)


def _check(y: torch.Tensor, x: torch.Tensor, oracle: np.ndarray, exact: np.ndarray) -> None:
    got = y.double().numpy()
    scale = np.abs(exact).max()
    # Same function: only float rounding (and a rare activation rounding tie) differ.
    tol = 8e-3 if y.dtype == torch.bfloat16 else 2e-4  # bf16 output: 2^-8 relative
    assert np.abs(got - oracle).max() <= tol * scale
    # And the function is close to the product with unquantized activations (8 bits per
    # value, one scale per 32).
    assert np.abs(got - exact).max() <= 3e-2 * scale


def _run(lin: GGUFLinear, x: torch.Tensor, path: str, lib: ctypes.CDLL | None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    if path == "torch":
        return kquant_matmul_torch(x, lin.parts, bias)
    return cpu_kernels.gguf_matmul(x.contiguous(), lin.desc, lin.out_features, bias, lib=lib)


@pytest.mark.parametrize("random_bytes", [False, True], ids=["packed", "random-bytes"])
@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kquant_matmul_matches_float64_oracle(gguf_paths, qtype: GT, shape, random_bytes: bool
                                              ) -> None:
    m, n, k = shape
    raw = _weights(qtype, n, k, seed=m * 1000 + n + int(qtype), random_bytes=random_bytes)
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    xd = x.double().numpy()
    oracle, exact = _act_oracle(xd) @ wd.T, xd @ wd.T
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, oracle, exact)


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_largest_quants_against_largest_activations_do_not_overflow(gguf_paths, qtype: GT
                                                                    ) -> None:
    """Every quant and scale bit set, activations quantizing to +-127 everywhere: the integer
    sums at their bound (the int16 stages of the AVX2 bodies included)."""
    rng = np.random.default_rng(9)
    raw = random_kblocks(qtype, 20, 512, rng)
    halves = set()
    for off in _HALF_OFFSETS[qtype]:
        halves |= {off, off + 1}
    blocks = raw.reshape(-1, BLOCK_BYTES[qtype])
    blocks[:, [c for c in range(BLOCK_BYTES[qtype]) if c not in halves]] = 0xff
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512)
    x = torch.ones(40, 512)
    x[1::3] = -1.0
    x[2::3, ::2] = -1.0
    for rows in (x[:3], x):  # Q6_K: 3 rows through its row body, 40 through the tiles
        xd = rows.double().numpy()
        oracle = _act_oracle(xd) @ wd.T
        for path, lib in gguf_paths:
            _check(_run(lin, rows, path, lib), rows, oracle, xd @ wd.T)


@pytest.mark.parametrize("qtype", [GT.Q3_K, GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.IQ4_XS],
                         ids=lambda t: t.name)
def test_every_row_tail_of_the_four_row_bodies(gguf_paths, qtype: GT) -> None:
    """The bodies run in passes of up to 4 activation rows (8 in the 512-bit tile bodies),
    each count its own compiled instance: 2 and 6 rows end on the 2-row one (the Q6_K row
    body's two FMA chains), 33 to 39 rows (many-row tiles for every type; in the AVX2 build
    the tiles expanded to bytes, ktile_gemm.c, from 8 rows, 3 or 4 a pass) on the 1- to 7-row
    ones; 8 and 10 rows are the fewest the AVX2 build expands."""
    n, k = 19, 512
    raw = random_kblocks(qtype, n, k, np.random.default_rng(int(qtype)))
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k)
    x = torch.randn(39, k, generator=torch.Generator().manual_seed(5))
    for m in (2, 6, 8, 10, 33, 34, 35, 36, 37, 39):
        xd = x[:m].double().numpy()
        for path, lib in gguf_paths:
            _check(_run(lin, x[:m], path, lib), x[:m], _act_oracle(xd) @ wd.T, xd @ wd.T)


@pytest.mark.parametrize("qtype", [GT.Q4_K, GT.Q5_K, GT.Q6_K, GT.Q3_K], ids=lambda t: t.name)
def test_prompt_sized_matmuls_through_the_expanded_tiles(gguf_paths, qtype: GT) -> None:
    """A call's chunk of rows (up to 256) runs against a group's tiles expanded to one byte
    per value (ktile_gemm.c; in the 512-bit build 8 rows a pass, Q3_K (in Q6_K's form) from
    16 rows, Q5_K and Q6_K from 32, Q4_K from 128; Q6_K and Q3_K against the activations plus
    128): 20 rows (expanded for Q3_K alone: its activations plus 128 made for it), 128 rows,
    131 (a 3-row tail pass) and 300 (an expanded chunk of 256, then 44 rows, expanded for all
    but Q4_K)."""
    n, k = 19, 512
    raw = random_kblocks(qtype, n, k, np.random.default_rng(100 + int(qtype)))
    wd = dequantize(raw, qtype).astype(np.float64)
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(11))
    x[130, 64:96] = 0.0  # an all-zero activation block (scale 0)
    for m in (20, 128, 131, 300):
        xd = x[:m].double().numpy()
        for path, lib in gguf_paths:
            _check(_run(lin, x[:m], path, lib), x[:m], _act_oracle(xd) @ wd.T, xd @ wd.T)
    xb = x[:131].bfloat16()  # bfloat16 in and out, as the engine runs it
    xd = xb.double().numpy()
    for path, lib in gguf_paths:
        _check(_run(lin, xb, path, lib), xb, _act_oracle(xd) @ wd.T, xd @ wd.T)


@pytest.mark.parametrize("qtype", [GT.Q4_K, GT.Q5_K, GT.Q6_K], ids=lambda t: t.name)
def test_one_row_agrees_with_each_row_of_a_two_row_call(gguf_variants, qtype: GT) -> None:
    """A decode step's one activation row takes its own body where there is one (the
    512-bit and AVX2 Q6_K bodies that read each tile line once for four blocks); two rows
    take the many-row bodies. Both make the same integer
    sums from the same quantized activations, so a row's outputs agree to float rounding
    (not bit for bit: -ffast-math lets each compiled instance order its float adds), over
    rows that end mid-tile and a k of nine super-blocks."""
    if not gguf_variants:
        pytest.skip("no C compiler here: only the torch fallback runs")
    n, k = 37, 2304
    raw = random_kblocks(qtype, n, k, np.random.default_rng(300 + int(qtype)))
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(12))
    for name, lib in gguf_variants.items():
        both = _run(lin, x, "c", lib)
        scale = float(both.abs().max())
        for i in range(2):
            one = _run(lin, x[i:i + 1], "c", lib)
            torch.testing.assert_close(one[0], both[i], rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda m, name=name, i=i: f"{name}, row {i}: {m}")


@pytest.mark.parametrize("march", ["icelake-server", "alderlake"])
def test_vnni_bodies_build(tmp_path: Path, march: str) -> None:
    """The VNNI bodies compile and link on any machine (they run, and are checked above,
    only where the CPU has the instructions; nothing of them is called here)."""
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler here")
    try:
        build_quant_variant(march, tmp_path, bind=lambda lib: None)
    except RuntimeError as exc:
        if "march" in str(exc):  # an older compiler without this -march
            pytest.skip(str(exc))
        raise
    assert (tmp_path / f"gguf_matmul-{march}.so").exists()


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_bias_bfloat16_and_module_call(gguf_paths, qtype: GT) -> None:
    raw = _weights(qtype, 40, 512, seed=7, random_bytes=False)
    wd = dequantize(raw, qtype).astype(np.float64)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(4))
    lin = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512,
                     torch.nn.Parameter(bias, requires_grad=False))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    for xin, b in ((x, bias), (x.bfloat16(), bias.bfloat16())):
        xd, bd = xin.double().numpy(), b.double().numpy()
        oracle, exact = _act_oracle(xd) @ wd.T + bd, xd @ wd.T + bd
        for path, lib in gguf_paths:
            y = _run(lin, xin, path, lib, b)
            assert y.dtype == xin.dtype
            _check(y, xin, oracle, exact)
    # The module itself (kernel where it is built), leading dimensions kept.
    lin.bias = torch.nn.Parameter(bias, requires_grad=False)
    y = lin(x.reshape(5, 1, 512))
    assert y.shape == (5, 1, 40)
    xd = x.double().numpy()
    _check(y.reshape(5, 40), x, _act_oracle(xd) @ wd.T + bias.double().numpy(),
           xd @ wd.T + bias.double().numpy())


def _fused_oracles(raws: list[tuple[GT, np.ndarray]], x: torch.Tensor, bias: torch.Tensor
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(the product with x quantized as the kernels do, the exact product) of the parts
    ``raws`` stacked, plus ``bias``, in float64."""
    xd = x.double().numpy()
    oracle = np.concatenate([_act_oracle(xd) @ dequantize(r, t).astype(np.float64).T
                             for t, r in raws], axis=1) + bias.double().numpy()
    exact = xd @ np.concatenate([dequantize(r, t) for t, r in raws]).astype(
        np.float64).T + bias.double().numpy()
    return oracle, exact


def test_fused_parts_of_both_families(gguf_paths) -> None:
    """q/k/v-like parts in Q4_K, Q8_0 and Q6_K (as Q4_K_M files mix them): one C call for
    all (the activations quantized once, per 32); the torch fallback runs each family's
    function on its columns."""
    rng = np.random.default_rng(5)
    k = 512
    raws = [(GT.Q4_K, pack_kquant(rng.standard_normal((24, k)).astype(np.float32), GT.Q4_K)),
            (GT.Q8_0, quantize(rng.standard_normal((8, k)).astype(np.float32), GT.Q8_0)),
            (GT.Q6_K, pack_kquant(rng.standard_normal((9, k)).astype(np.float32), GT.Q6_K)),
            (GT.Q5_K, pack_kquant(rng.standard_normal((3, k)).astype(np.float32), GT.Q5_K))]
    bias = torch.randn(44, generator=torch.Generator().manual_seed(1))
    lin = GGUFLinear([(int(t), torch.from_numpy(r.copy())) for t, r in raws], k,
                     torch.nn.Parameter(bias, requires_grad=False))
    assert [kq for kq, _ in lin.family_runs()] == [True, False, True]
    assert "Q4_K+Q8_0+Q6_K+Q5_K" in repr(lin)
    for m in (1, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        oracle, exact = _fused_oracles(raws, x, bias)
        _check(lin(x), x, oracle, exact)
        with pytest.MonkeyPatch.context() as mp:  # the pure-torch path
            mp.setattr(cpu_kernels, "supports", lambda *a: False)
            _check(lin(x), x, oracle, exact)


def test_bfloat16_parts_of_four_types_with_bias() -> None:
    """bf16 in and out with a bias, parts in Q3_K, Q8_0, Q6_K and Q2_K: the tiles read and
    write bf16 as it is; every column gets its own bias (the oracle rounds to bf16 once)."""
    rng = np.random.default_rng(9)
    k = 512
    raws = [(GT.Q3_K, pack_kquant(rng.standard_normal((5, k)).astype(np.float32), GT.Q3_K)),
            (GT.Q8_0, quantize(rng.standard_normal((20, k)).astype(np.float32), GT.Q8_0)),
            (GT.Q6_K, pack_kquant(rng.standard_normal((16, k)).astype(np.float32), GT.Q6_K)),
            (GT.Q2_K, pack_kquant(rng.standard_normal((7, k)).astype(np.float32), GT.Q2_K))]
    bias = torch.randn(48, generator=torch.Generator().manual_seed(2)).bfloat16()
    lin = GGUFLinear([(int(t), torch.from_numpy(r.copy())) for t, r in raws], k,
                     torch.nn.Parameter(bias, requires_grad=False))
    for m in (1, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        oracle, exact = _fused_oracles(raws, x, bias)
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 48)
        _check(y, x.float(), oracle, exact)


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_dequantized_rows_are_the_files_values(qtype: GT) -> None:
    for random_bytes in (False, True):
        raw = _weights(qtype, 30, 512, seed=11, random_bytes=random_bytes)
        want = dequantize(raw, qtype)
        got = dequantize_krows(int(qtype), torch.from_numpy(raw.copy()), 512)
        assert np.array_equal(got.numpy(), want)
    table = GGUFLinear([(int(qtype), torch.from_numpy(raw.copy()))], 512)
    assert np.array_equal(table.parts[0][1].numpy(), raw)  # held as the file's bytes
    emb = GGUFEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 0, 29], [3, 3, 17]])
    assert torch.equal(emb(ids), torch.from_numpy(want)[ids])
    # No copy; the tiles pad the rows to whole groups of 16.
    assert resident_weight_bytes(emb) == 32 * raw.shape[1]


def test_relocated_blocks_are_read_from_their_new_place() -> None:
    raw = _weights(GT.Q4_K, 20, 256, seed=2, random_bytes=False)
    lin = GGUFLinear([(int(GT.Q8_0), torch.from_numpy(quantize(
        np.ones((4, 256), np.float32), GT.Q8_0))), (int(GT.Q4_K), torch.from_numpy(raw))], 256)
    x = torch.randn(2, 256)
    want = lin(x)
    copies = [t.clone() for t in lin.resident_tensors()]
    for t in lin.resident_tensors():
        t.zero_()  # the old place no longer holds the weights
    lin.relocate(copies)
    assert torch.equal(lin(x), want)


def test_rows_must_be_whole_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        GGUFLinear([(int(GT.Q4_K), torch.zeros(4, 72, dtype=torch.uint8))], 128)
    with pytest.raises(ValueError, match="Q6_K rows of 256 values"):
        GGUFLinear([(int(GT.Q6_K), torch.zeros(4, 200, dtype=torch.uint8))], 256)


@pytest.mark.parametrize("qtype", KTYPES, ids=lambda t: t.name)
def test_torch_fallback_stays_on_the_weights_device(qtype: GT) -> None:
    """Off the CPU (CUDA) only the torch path runs: nothing in it may be made on the CPU
    (checked on the meta device, which refuses to mix with it)."""
    raw = torch.zeros(3, 2 * BLOCK_BYTES[qtype], dtype=torch.uint8, device="meta")
    y = kquant_matmul_torch(torch.zeros(2, 512, device="meta"), [(int(qtype), raw)], None)
    assert y.shape == (2, 3) and y.device.type == "meta"
