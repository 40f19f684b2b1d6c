"""The C decode-attention kernel and the pure-torch decode path against a float64 oracle.

The oracle walks every sequence's slots one by one (block table -> block, offset) and runs
textbook softmax attention in float64, so it shares no code or layout trick with either path.
"""

from __future__ import annotations

import math

import pytest
import torch

from forerun.model import cpu_kernels
from forerun.model.attention import AttentionMetadata, decode_attention_torch, kv_cache_shape

needs_kernel = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler: the kernel cannot be built"
)


def _case(seed: int, seq_lens: list[int], heads: int, kv_heads: int, block_size: int,
          head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    shape = kv_cache_shape(num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scrambled, non-contiguous
    width = max(-(-n // block_size) for n in seq_lens) + 2  # wider than needed, like the runner
    tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = free.pop()
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(seq_lens)])
    meta = AttentionMetadata.build(list(range(len(seq_lens) + 1)), seq_lens, tables, slots,
                                   block_size, torch.device("cpu"))
    return q, k_cache, v_cache, tables, meta


def _oracle(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    b, heads, d = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(b, heads, d, dtype=torch.float64)
    for i, n in enumerate(seq_lens):
        rows = [(int(tables[i, p // block_size]), p % block_size) for p in range(n)]
        for h in range(heads):
            kvh = h // group
            keys = torch.stack([k_cache[blk, kvh, off] for blk, off in rows]).double()
            vals = torch.stack([v_cache[blk, kvh, off] for blk, off in rows]).double()
            probs = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = probs @ vals
    return out


CASES = [
    # seq_lens, heads, kv_heads, block_size, head_dim
    ([1, 5, 16, 17, 33], 9, 3, 16, 64),  # SmolLM2's head shape; block boundaries
    ([3, 8, 9, 4], 4, 2, 4, 32),
    ([40, 1, 7], 4, 4, 8, 16),  # no GQA
    ([64] * 6, 6, 1, 16, 64),  # one kv head shared by all; every context equally long
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_matches_float64_oracle(case: int, dtype: torch.dtype) -> None:
    seq_lens, heads, kv_heads, block_size, head_dim = CASES[case]
    q, kc, vc, tables, meta = _case(case, seq_lens, heads, kv_heads, block_size, head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
    got = cpu_kernels.paged_decode_attention(q, kc, vc, meta.decode_blocks,
                                             meta.decode_seq_lens, scale)
    want = _oracle(q, kc, vc, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: only summation order differs; bfloat16: one rounding of the output.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_torch_decode_path_matches_float64_oracle(case: int) -> None:
    seq_lens, heads, kv_heads, block_size, head_dim = CASES[case]
    q, kc, vc, tables, meta = _case(case, seq_lens, heads, kv_heads, block_size, head_dim,
                                    torch.float32)
    scale = 1 / math.sqrt(head_dim)
    got = decode_attention_torch(q, kc, vc, meta, scale)
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, tables, seq_lens, scale),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_c_kernel_reads_only_each_sequences_own_blocks() -> None:
    # Poison every block no sequence owns: a kernel reading past a sequence's length or
    # through a padded table entry would turn the output into NaN.
    seq_lens = [5, 16, 20]
    q, kc, vc, tables, meta = _case(7, seq_lens, 4, 2, 8, 32, torch.float32)
    owned = {int(tables[i, j]) for i, n in enumerate(seq_lens) for j in range(-(-n // 8))}
    for blk in set(range(kc.shape[0])) - owned:
        kc[blk] = float("nan")
        vc[blk] = float("nan")
    for i, n in enumerate(seq_lens):  # and the unused tail of each last block
        last = int(tables[i, (n - 1) // 8])
        kc[last, :, n % 8 or 8:] = float("nan")
        vc[last, :, n % 8 or 8:] = float("nan")
    assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
    got = cpu_kernels.paged_decode_attention(q, kc, vc, meta.decode_blocks,
                                             meta.decode_seq_lens, 0.2)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), _oracle(q, kc, vc, tables, seq_lens, 0.2),
                               atol=1e-5, rtol=1e-5)
