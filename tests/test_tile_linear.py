"""bfloat16 linears on the small-batch path's packed copy (``TileLinear``): the register-tile
GEMM against float64, and a model that keeps one copy of its weights where that GEMM
serves every step, with the logits of oneDNN's reordered copy (FORERUN_CPU_BF16_TILES=0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forerun.model import cpu_kernels
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.packed_linear import PackedLinear, TileLinear, prepack_supported
from tests.paged_driver import PagedDriver
from tests.tiny_model import write_tiny_llama

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler: the kernels cannot be built")


@pytest.mark.parametrize("rows", [1, 9, 200])
def test_tile_linear_matches_float64_with_bias_and_leading_dimensions(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(80, 96, generator=gen) * 0.1).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16()
    x = torch.randn(rows, 2, 96, generator=gen).bfloat16()
    lin = TileLinear(cpu_kernels.pack_small_matmul_weight(w), b)
    got = lin(x.transpose(0, 1))  # not contiguous: the module makes it so
    want = x.transpose(0, 1).double() @ w.double().T + b.double()
    assert got.shape == (2, rows, 80) and got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() / (want.abs() + 1.0)).max().item() < 8e-3


def _load(folder: Path, monkeypatch: pytest.MonkeyPatch, tiles: str) -> torch.nn.Module:
    monkeypatch.setenv("FORERUN_CPU_BF16_TILES", tiles)
    source = resolve_model(str(folder))
    return load_model(source, load_model_config(source), torch.bfloat16, CPU)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tiles")
    write_tiny_llama(folder)
    return folder


def test_bfloat16_model_keeps_one_copy_and_the_logits_of_onednn(
        tiny_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not prepack_supported(torch.bfloat16, CPU):
        pytest.skip("no oneDNN bf16 linear on this CPU")
    tiled = _load(tiny_folder, monkeypatch, "1")
    if not tiled.small_batch.serves_every_step(torch.bfloat16):
        pytest.skip("no AVX512-BF16 register tiles here, or AMX (oneDNN keeps its copy)")
    onednn = _load(tiny_folder, monkeypatch, "0")
    layer_linears = [m for layer in tiled.model.layers
                     for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(m, TileLinear) for m in layer_linears + [tiled.lm_head])
    assert not any(isinstance(m, PackedLinear) for m in tiled.modules())
    assert isinstance(onednn.lm_head, PackedLinear)
    # The second copy is gone: every linear weight (bf16, 2 bytes a value) held once less.
    copy_bytes = 2 * sum(m.in_features * m.out_features for m in layer_linears + [tiled.lm_head])
    assert onednn.resident_weight_bytes - tiled.resident_weight_bytes >= copy_bytes
    # A 150-token prompt runs op by op (past the small-batch path's 128), then a decode
    # step on the stack: both through the tiles, against oneDNN's GEMM on the same weights.
    prompt = [(7 * i + 3) % 300 + 3 for i in range(150)]
    with torch.inference_mode():
        runs = []
        for model in (tiled, onednn):
            driver = PagedDriver(model)
            logits = driver.step([("a", prompt)])[0]
            runs.append((logits, driver.step([("a", [int(logits[-1].argmax())])])[0]))
    for got, want in zip(runs[0], runs[1], strict=True):
        # Both sum in float32 and round each layer's outputs to bfloat16, in other orders.
        assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
    agree = (runs[0][0].argmax(-1) == runs[1][0].argmax(-1)).float().mean().item()
    assert agree >= 0.95
