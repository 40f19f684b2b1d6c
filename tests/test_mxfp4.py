"""MXFP4 (gpt-oss's expert format) computed in its blocks: every kernel body this machine can
run (each built on its own with ``-march=``, tests/kernel_variants.py) and the torch fallback
against float64 oracles from ``gguf``'s own ``gguf.quants.dequantize`` of the same bytes
times the int8-rounded activations; then a tiny Llama with MXFP4 MLP weights and a tiny MoE
with MXFP4 experts against the same files dequantized.

The blocks come from ``gguf.quants.quantize`` (which writes MXFP4) and from random bytes
(every nibble, exponents of every sane size); the oracle never reads forerun's idea of the
format.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from forerun.model import cpu_kernels
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.quant import resident_weight_bytes
from forerun.model.quant.gguf_blocks import dequantize_rows, gguf_matmul_torch
from forerun.model.quant.gguf_linear import GGUFEmbedding, GGUFLinear
from tests.paged_driver import PagedDriver
from tests.test_moe import COMMON, PROMPT, _write_moe_gguf
from tests.test_quant_e2e import _paged_logits, _write_tiny_gguf

CPU = torch.device("cpu")
MX = int(GT.MXFP4)
# (m rows of x, n outputs, k inputs): decode (1 row) and prefill (64), rows not a multiple
# of 16, k one block and 32 * odd.
SHAPES = [(1, 37, 32), (1, 96, 544), (3, 17, 160), (64, 45, 96), (64, 8, 1056)]


def _random_blocks(n: int, k: int, rng: np.random.Generator, nibble: int | None = None
                   ) -> np.ndarray:
    """MXFP4 rows [n, k / 32 * 17] of random bytes (or every nibble ``nibble``), exponents
    2^-17 .. 2^13 (no float32 overflow in the oracle's products)."""
    blocks = rng.integers(0, 256, size=(n * (k // 32), 17), dtype=np.uint8)
    if nibble is not None:
        blocks[:, 1:] = nibble * 0x11
    blocks[:, 0] = rng.integers(110, 141, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(n, -1)


def _act_oracle(x: np.ndarray) -> np.ndarray:
    """x after the kernels' activation quantization (per 32, max|x| / 127, round half to
    even), in float64."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    s = np.abs(xb).max(axis=-1, keepdims=True) / 127.0
    q = np.round(np.divide(xb, s, out=np.zeros_like(xb), where=s > 0))
    return (q * s).reshape(m, k)


def _check(y: torch.Tensor, x: torch.Tensor, wd: np.ndarray, bias: np.ndarray | None = None
           ) -> None:
    xd = x.double().numpy()
    extra = 0 if bias is None else bias
    exact, oracle = xd @ wd.T + extra, _act_oracle(xd) @ wd.T + extra
    got = y.double().numpy()
    scale = np.abs(exact).max()
    # Same function: only float rounding (and a rare activation rounding tie) differ.
    tol = 8e-3 if y.dtype == torch.bfloat16 else 2e-4  # bf16 output: 2^-8 relative
    assert np.abs(got - oracle).max() <= tol * scale
    # And close to the product with unquantized activations (8 bits, one scale per 32).
    assert np.abs(got - exact).max() <= 3e-2 * scale


def _run(lin: GGUFLinear, x: torch.Tensor, path: str, lib: ctypes.CDLL | None,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    if path == "torch":
        return gguf_matmul_torch(x, lin.parts, bias)
    return cpu_kernels.gguf_matmul(x.contiguous(), lin.desc, lin.out_features, bias, lib=lib)


@pytest.mark.parametrize("random_bytes", [False, True], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mxfp4_matmul_matches_float64_oracle(gguf_paths, shape, random_bytes: bool) -> None:
    m, n, k = shape
    rng = np.random.default_rng(m * 1000 + n)
    raw = (_random_blocks(n, k, rng) if random_bytes
           else quantize(rng.standard_normal((n, k)).astype(np.float32), GT.MXFP4))
    wd = dequantize(raw, GT.MXFP4).astype(np.float64)
    lin = GGUFLinear([(MX, torch.from_numpy(raw.copy()))], k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # an all-zero activation block (scale 0)
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, wd)


@pytest.mark.parametrize("nibble", [7, 15], ids=["plus-6", "minus-6"])
def test_largest_levels_against_largest_activations_do_not_overflow(gguf_paths, nibble: int
                                                                    ) -> None:
    """Every value +-6 (u = 24 or 0 in the kernels), activations quantizing to +-127: the
    AVX2 body's int16 sums at their bound."""
    raw = _random_blocks(20, 512, np.random.default_rng(nibble), nibble=nibble)
    wd = dequantize(raw, GT.MXFP4).astype(np.float64)
    lin = GGUFLinear([(MX, torch.from_numpy(raw.copy()))], 512)
    x = torch.ones(6, 512)
    x[1::3] = -1.0
    x[2::3, ::2] = -1.0
    for path, lib in gguf_paths:
        _check(_run(lin, x, path, lib), x, wd)


def test_bias_bfloat16_and_parts_of_other_types(gguf_paths) -> None:
    """A gate/up-like linear of an MXFP4 part, a Q8_0 part and a Q6_K part (another kernel
    family), with bias, in float32 and bfloat16; and the module call."""
    rng = np.random.default_rng(3)
    k = 256
    raws = [(GT.MXFP4, quantize(rng.standard_normal((24, k)).astype(np.float32), GT.MXFP4)),
            (GT.Q8_0, quantize(rng.standard_normal((8, k)).astype(np.float32), GT.Q8_0)),
            (GT.MXFP4, _random_blocks(9, k, rng))]
    wd = np.concatenate([dequantize(r, t) for t, r in raws]).astype(np.float64)
    bias = torch.randn(41, generator=torch.Generator().manual_seed(4))
    lin = GGUFLinear([(int(t), torch.from_numpy(r.copy())) for t, r in raws], k,
                     torch.nn.Parameter(bias, requires_grad=False))
    assert "MXFP4+Q8_0+MXFP4" in repr(lin)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    for xin, b in ((x, bias), (x.bfloat16(), bias.bfloat16())):
        for path, lib in gguf_paths:
            y = _run(lin, xin, path, lib, b)
            assert y.dtype == xin.dtype
            _check(y, xin.float(), wd, b.double().numpy())
    y = lin(x.reshape(5, 1, k))  # the kernel where it is built; leading dimensions kept
    assert y.shape == (5, 1, 41)
    _check(y.reshape(5, 41), x, wd, bias.double().numpy())


def test_dequantized_rows_are_the_files_values() -> None:
    """Every exponent (subnormal scales at 0 and 1 included) and every nibble: the file's
    values exactly, through the tiles and back, and as embedding rows."""
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, size=(30, 96 // 32 * 17), dtype=np.uint8)
    raw.reshape(-1, 17)[:, 0] = np.arange(90) * 3 % 256  # exponents 0, 1, ... 255
    raw.reshape(-1, 17)[:3, 0] = [0, 1, 255]
    with np.errstate(over="ignore"):  # exponent 255 times 6: inf, in gguf's and ours
        want = dequantize(raw, GT.MXFP4)
    got = dequantize_rows(MX, torch.from_numpy(raw.copy()), 96)
    assert np.array_equal(got.numpy(), want, equal_nan=True)
    table = GGUFLinear([(MX, torch.from_numpy(raw.copy()))], 96)
    assert np.array_equal(table.parts[0][1].numpy(), raw)  # the tiles hold the file's bytes
    emb = GGUFEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 0, 29], [3, 3, 17]])
    assert np.array_equal(emb(ids).numpy(), want[ids.numpy()], equal_nan=True)
    assert resident_weight_bytes(emb) == 32 * raw.shape[1]  # two tiles of 16 rows


def test_torch_fallback_stays_on_the_weights_device() -> None:
    """Off the CPU (CUDA) only the torch path runs: nothing in it may be made on the CPU
    (checked on the meta device, which refuses to mix with it)."""
    meta = torch.zeros(3, 2 * 17, dtype=torch.uint8, device="meta")
    y = gguf_matmul_torch(torch.zeros(2, 64, device="meta"), [(MX, meta)], None)
    assert y.shape == (2, 3) and y.device.type == "meta"


_MXFP4_MLP = {"ffn_gate.weight": GT.MXFP4, "ffn_up.weight": GT.MXFP4,
              "ffn_down.weight": GT.MXFP4}


@pytest.mark.usefixtures("private_model_cache")
@pytest.mark.parametrize("path", ["small-batch", "op-by-op", "torch"])
def test_tiny_llama_with_mxfp4_mlp_computes_in_its_blocks(tmp_path: Path, monkeypatch,
                                                          caplog, path: str) -> None:
    """MLP weights in MXFP4, the rest Q8_0: every linear in its blocks, the logits those of
    the same file dequantized up to the activation quantization, each path the torch
    function's."""
    file = tmp_path / "tiny-mxfp4.gguf"
    _write_tiny_gguf(file, GT.Q8_0, tied=True, seed=39, types=_MXFP4_MLP)
    source = resolve_model(str(file))
    config = load_model_config(source)
    exact = load_model(source, config, torch.float32, CPU)
    if path == "op-by-op":
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    with caplog.at_level(logging.INFO, logger="forerun.model.loader"):
        ours = load_model(source, config, torch.float32, CPU, quantization="gguf")
    assert any("every quantized tensor" in r.message for r in caplog.records)
    for layer in ours.model.layers:
        assert [t for t, _, _ in layer.mlp.gate_up_proj.tiles] == [MX, MX]
        assert [t for t, _, _ in layer.mlp.down_proj.tiles] == [MX]
    assert ours.small_batch.can_run(torch.float32)
    want = _paged_logits(exact)
    with monkeypatch.context() as mp:  # the pure-torch function, as reference
        mp.setattr(cpu_kernels, "supports", lambda *a: False)
        ref = _paged_logits(ours)
    got = ref if path == "torch" else _paged_logits(ours)
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale
    assert (got - ref).abs().max() < 2e-3 * scale


@pytest.mark.usefixtures("private_model_cache")
def test_tiny_moe_with_mxfp4_experts_matches_the_dequantized_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's layout in small: the stacked experts (3-D) in MXFP4, attention in Q8_0;
    quantization="gguf" (op by op and through the one-call stack's MoE block) against the
    same file dequantized."""
    torch.manual_seed(39)
    cfg = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 2}, head_dim=32, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=96, norm_topk_prob=True)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    path = tmp_path / "moe-mxfp4.gguf"
    _write_moe_gguf(hf, path, {"_exps.weight": GT.MXFP4, "attn_q.weight": GT.Q8_0,
                               "attn_k.weight": GT.Q8_0, "attn_v.weight": GT.Q8_0,
                               "attn_output.weight": GT.Q8_0})
    source = resolve_model(str(path))
    config = load_model_config(source)
    exact = load_model(source, config, torch.float32, CPU)
    quant = load_model(source, config, torch.float32, CPU, quantization="gguf")
    for layer in quant.model.layers:
        moe = layer.mlp
        assert moe.w13 is None and len(moe.quant_experts) == 4
        gate_up, down = moe.quant_experts[2]
        assert [t for t, _, _ in gate_up.tiles] == [MX, MX]
        assert [t for t, _, _ in down.tiles] == [MX]
    with torch.inference_mode():
        ref = PagedDriver(exact).step([("a", PROMPT)])[0]
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")  # op by op
        got = PagedDriver(quant).step([("a", PROMPT)])[0]
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
        stacked = PagedDriver(quant).step([("a", PROMPT)])[0]
        assert quant.small_batch.mode == "gguf"
        torch.testing.assert_close(stacked, got, atol=1e-4, rtol=1e-4)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 0.05, f"max logit error {err:.4f} of the largest logit"
