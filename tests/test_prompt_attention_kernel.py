"""csrc/prompt_attention.c (prefill attention as tiled bf16 matrix products) against a float64
oracle: textbook softmax attention over each query's visible keys, sharing no code or
blocking with the kernel; and the attention dispatch that sends bf16 prompts to it."""

from __future__ import annotations

import math

import pytest
import torch

from forerun.model import attention, cpu_kernels
from forerun.model.attention import AttentionMetadata, new_kv_cache, paged_attention
from tests.kernel_variants import build_quant_variant

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.has_prompt_attention(torch.bfloat16),
    reason="the prompt attention kernel needs AVX512-BF16")


def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prompts: int, n_q: int,
           n_k: int, scale: float, window: int | None = None) -> torch.Tensor:
    heads, d = q.shape[1], q.shape[2]
    group = heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for c in range(n_prompts):
        for i in range(n_q):
            pos = n_k - n_q + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                keys = k[c * n_k + first:c * n_k + pos + 1, h // group].double()
                vals = v[c * n_k + first:c * n_k + pos + 1, h // group].double()
                probs = torch.softmax(keys @ q[c * n_q + i, h].double() * scale, 0)
                out[c * n_q + i, h] = probs @ vals
    assert out.shape[2] == d
    return out


SHAPES = [
    # n_prompts, n_q, n_k, heads, kv heads, head_dim
    (1, 150, 150, 8, 2, 64),    # keys across three blocks of 64; 16 tokens per item
    (3, 37, 37, 4, 2, 64),      # several prompts of one length
    (1, 70, 200, 4, 4, 128),    # a chunk after 130 tokens of context; no GQA; 2 rows per pass
    (2, 66, 66, 6, 2, 32),      # three heads per kv head: 21 tokens (63 rows) per item
    (1, 1, 1, 4, 1, 256),       # one token; one row per pass
    (1, 130, 130, 1, 1, 64),    # 64 tokens per item, the last item 2 tokens
    (1, 9, 9, 80, 2, 96),       # 40 heads per kv head (one token per item); head_dim 96
]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_prompt_attention_matches_float64_oracle(shape: tuple[int, ...]) -> None:
    n_prompts, n_q, n_k, heads, kv_heads, d = shape
    gen = torch.Generator().manual_seed(sum(shape))
    # q as a view into fused rows (the model's qkv split); k and v head-major, as a gathered
    # context is.
    fused = torch.randn(n_prompts * n_q, (heads + 1) * d, generator=gen).bfloat16()
    q = fused[:, :heads * d].view(-1, heads, d)
    k = torch.randn(kv_heads, n_prompts * n_k, d, generator=gen).bfloat16().transpose(0, 1)
    v = (2 * torch.randn(n_prompts * n_k, kv_heads, d, generator=gen)).bfloat16()
    scale = 1 / math.sqrt(d)
    got = cpu_kernels.prompt_attention(q, k, v, n_prompts, n_q, n_k, scale)
    assert got.shape == q.shape and got.is_contiguous()
    # bf16 inputs to both products and a bf16 output: a few ulps of bf16 at |out| ~ 1-3.
    torch.testing.assert_close(got.double(), oracle(q, k, v, n_prompts, n_q, n_k, scale),
                               atol=2e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 64, 100, 129])
def test_prompt_attention_with_a_sliding_window_matches_float64_oracle(window: int) -> None:
    """Windows shorter than a key block, across block edges, and as long as the chunk."""
    gen = torch.Generator().manual_seed(window)
    n_q, n_k = 90, 130
    q = torch.randn(2 * n_q, 4, 64, generator=gen).bfloat16()
    k = torch.randn(2 * n_k, 2, 64, generator=gen).bfloat16()
    v = torch.randn(2 * n_k, 2, 64, generator=gen).bfloat16()
    got = cpu_kernels.prompt_attention(q, k, v, 2, n_q, n_k, 0.125, window)
    torch.testing.assert_close(got.double(), oracle(q, k, v, 2, n_q, n_k, 0.125, window),
                               atol=2e-2, rtol=1e-2)


@needs_kernel
def test_prompt_attention_is_causal_and_ignores_later_keys() -> None:
    """Changing the keys and values after a query's position changes nothing for it."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(100, 4, 64, generator=gen).bfloat16()
    k = torch.randn(100, 2, 64, generator=gen).bfloat16()
    v = torch.randn(100, 2, 64, generator=gen).bfloat16()
    before = cpu_kernels.prompt_attention(q, k, v, 1, 100, 100, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[70:], v2[70:] = 50.0, -50.0
    after = cpu_kernels.prompt_attention(q, k2, v2, 1, 100, 100, 0.125)
    assert torch.equal(before[:70], after[:70])
    assert not torch.allclose(before[70:], after[70:])


@needs_kernel
def test_prompt_attention_refuses_head_sizes_it_does_not_take() -> None:
    q = torch.zeros(4, 2, 48, dtype=torch.bfloat16)
    k = torch.zeros(4, 1, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported shape"):
        cpu_kernels.prompt_attention(q, k, k, 1, 4, 4, 0.1)


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_prompts_and_long_context_chunks_run_on_the_prompt_kernel_without_amx(
        monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """A step of a fresh prompt, a long chunk with context and a decode: both prefill kinds go
    to the kernel on a CPU without AMX, to SDPA (its tiles on AMX) on one with, and the
    step's output matches the float64 oracle of the whole step either way."""
    monkeypatch.setattr(attention, "CONTEXT_CHUNK_MIN_TOKENS", 16)
    monkeypatch.setattr(cpu_kernels, "small_matmul_has_amx", lambda: amx)
    calls: list[tuple[int, int, int]] = []
    real = cpu_kernels.prompt_attention

    def spy(q, k, v, n_prompts, n_q, n_k, scale, window=None):  # noqa: ANN001, ANN202
        calls.append((n_prompts, n_q, n_k))
        return real(q, k, v, n_prompts, n_q, n_k, scale, window)

    monkeypatch.setattr(cpu_kernels, "prompt_attention", spy)
    gen = torch.Generator().manual_seed(11)
    heads, kvh, d, bs = 8, 2, 64, 16
    seqs = [(0, 40), (30, 20), (12, 1)]  # (context, new tokens)
    num_blocks = 16
    k_cache, v_cache = new_kv_cache(num_blocks, bs, kvh, d, torch.bfloat16, torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    qsl, seq_lens, slots = [0], [], []
    for i, (ctx, n) in enumerate(seqs):
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(ctx, ctx + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    t = qsl[-1]
    q = torch.randn(t, heads, d, generator=gen).bfloat16()
    k = torch.randn(t, kvh, d, generator=gen).bfloat16()
    v = torch.randn(t, kvh, d, generator=gen).bfloat16()
    meta = AttentionMetadata.build(qsl, seq_lens, tables, torch.tensor(slots), bs,
                                   torch.device("cpu"))
    kc, vc = k_cache.clone(), v_cache.clone()
    out = paged_attention(q, k, v, kc, vc, meta, 0.125).view(t, heads, d)
    assert calls == ([] if amx else [(1, 40, 40), (1, 20, 50)])
    # Oracle: each sequence's keys and values as the cache now holds them (k is stored
    # [block, kv head, dim, offset]).
    for i, (ctx, n) in enumerate(seqs):
        pos = torch.arange(ctx + n)
        blocks, offs = tables[i, pos // bs], pos % bs
        keys = kc[blocks, :, :, offs]
        vals = vc[blocks, :, offs]
        want = oracle(q[qsl[i]:qsl[i + 1]], keys, vals, 1, n, ctx + n, 0.125)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), want, atol=2e-2, rtol=1e-2)


def test_prompt_attention_reports_unavailable_without_avx512_bf16(tmp_path) -> None:  # noqa: ANN001
    """A build for a CPU without AVX512-BF16 says so and refuses every call (the caller then
    keeps SDPA), rather than computing with instructions the CPU lacks."""
    lib = build_quant_variant("haswell", tmp_path, cpu_kernels.PROMPT_ATTENTION_SOURCES,
                              cpu_kernels.bind_prompt_attention)
    assert lib.prompt_attention_available() == 0
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    rc = lib.prompt_attention_bf16(q.data_ptr(), 128, q.data_ptr(), 128, 64, q.data_ptr(), 128,
                                   64, q.data_ptr(), 1, 4, 4, 2, 2, 64, 0.1, 0)
    assert rc == -2
