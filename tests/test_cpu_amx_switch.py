"""``FORERUN_CPU_AMX=0`` / :func:`cpu_kernels.set_cpu_amx`: on a CPU with AMX, every AMX body
of the kernel library declines and the kernels take the paths a CPU without AMX takes, so
those paths can be measured there. Off, each kernel gives its non-AMX body's result bit for
bit (that body selected by the kernel's own switch as the oracle); on again, AMX is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT

from forerun.model import cpu_kernels
from forerun.model.quant.gguf_linear import GGUFLinear
from tests.kernel_variants import cpu_flags
from tests.kquant_pack import pack_kquant


@pytest.fixture(autouse=True)
def amx_cpu() -> Iterator[None]:
    if not {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags():
        pytest.skip("no AMX on this CPU: every kernel already takes its non-AMX path")
    if not cpu_kernels.supports(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no C compiler here")
    assert cpu_kernels.small_matmul_has_amx()
    yield
    cpu_kernels.set_cpu_amx(True)


def test_off_every_kernel_gives_its_non_amx_result() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 512, generator=gen).bfloat16()
    raw = pack_kquant(np.random.default_rng(1).standard_normal((48, 512)).astype(np.float32),
                      GT.Q4_K)
    lin = GGUFLinear([(int(GT.Q4_K), torch.from_numpy(raw))], 512)
    w = torch.randn(48, 512, generator=gen).bfloat16()
    packed = cpu_kernels.pack_small_matmul_weight(w)

    def run() -> list[torch.Tensor]:
        return [lin(x), cpu_kernels.rowmajor_matmul(x, w),
                cpu_kernels.small_matmul(x, packed, None)]

    with_amx = run()
    previous = cpu_kernels.set_cpu_amx(False)
    assert previous and not cpu_kernels.small_matmul_has_amx()
    off = run()
    with pytest.raises(RuntimeError, match="AMX body"):
        cpu_kernels._small_matmul_call("small_matmul_amx", x, packed, None)
    cpu_kernels.set_cpu_amx(True)
    # Oracles: each kernel's own switch to its non-AMX body (the small matmul has none: its
    # result without AMX must differ from the tile path's, and match torch closely).
    cpu_kernels.set_gguf_amx(False)
    cpu_kernels.set_rowmajor_amx(False)
    try:
        oracle = run()[:2]
    finally:
        cpu_kernels.set_gguf_amx(True)
        cpu_kernels.set_rowmajor_amx(True)
    assert torch.equal(off[0], oracle[0]) and not torch.equal(off[0], with_amx[0])
    assert torch.equal(off[1], oracle[1])
    torch.testing.assert_close(off[2].float(), (x.float() @ w.float().T), atol=0.05, rtol=0.02)
    assert cpu_kernels.small_matmul_has_amx()  # on again
    assert all(torch.equal(a, b) for a, b in zip(run(), with_amx, strict=True))


def test_the_environment_switch_applies_when_the_library_loads() -> None:
    code = ("from forerun.model import cpu_kernels; import torch; "
            "cpu_kernels.supports(torch.bfloat16, torch.device('cpu')); "
            "print(cpu_kernels.small_matmul_has_amx())")
    for value, want in (("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, env={**os.environ, "FORERUN_CPU_AMX": value})
        assert out.stdout.strip() == want
