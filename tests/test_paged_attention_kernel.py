"""Paged attention on CPU: the C kernels and the pure-torch path against a float64 oracle.

Each case is a mixed step: decodes, prompts starting at position 0 and prefill chunks with
earlier context, over scrambled non-contiguous blocks. The oracle walks every token's
visible positions one by one (block table -> block, offset; the step's own new K/V for the
positions it writes) and runs textbook softmax attention in float64, so it shares no code
or layout trick with either implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from forerun.model import attention, cpu_kernels
from forerun.model.attention import AttentionMetadata, new_kv_cache, paged_attention

needs_kernels = pytest.mark.skipif(
    cpu_kernels.kernel_library() is None, reason="no C compiler: the kernels cannot be built"
)
CPU = torch.device("cpu")


class Step:
    """A random step: cache with earlier context filled in, the step's new q/k/v rows."""

    def __init__(self, seed: int, seqs: list[tuple[int, int]], heads: int, kv_heads: int,
                 block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.heads = seqs, block_size, heads
        num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 4
        k_cache, v_cache = new_kv_cache(num_blocks, block_size, kv_heads, head_dim, dtype, CPU)
        self.k_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(v_cache.shape, generator=gen).to(dtype)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(-(-(c + q) // block_size) for c, q in seqs) + 1
        self.tables = torch.zeros(len(seqs), width, dtype=torch.long)
        slots, qsl, seq_lens = [], [0], []
        for i, (ctx, q_len) in enumerate(seqs):
            for j in range(-(-(ctx + q_len) // block_size)):
                self.tables[i, j] = free.pop()
            slots += [self.slot(i, p) for p in range(ctx, ctx + q_len)]
            qsl.append(qsl[-1] + q_len)
            seq_lens.append(ctx + q_len)
        t = qsl[-1]
        # q/k/v as views into one fused row, the way the model's qkv split hands them over.
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        self.q = q.view(t, heads, head_dim)
        self.k = k.view(t, kv_heads, head_dim)
        self.v = v.view(t, kv_heads, head_dim)
        self.meta = AttentionMetadata.build(qsl, seq_lens, self.tables, torch.tensor(slots),
                                            block_size, CPU)
        self.qsl = qsl

    def slot(self, i: int, pos: int) -> int:
        return int(self.tables[i, pos // self.block_size]) * self.block_size + pos % self.block_size

    def run(self, window: int | None = None, softcap: float | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        scale = 1 / math.sqrt(self.q.shape[-1])
        return paged_attention(self.q, self.k, self.v, kc, vc, self.meta, scale, window,
                               softcap, sinks)

    def oracle(self, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Position ``pos`` sees ``max(0, pos - window + 1) .. pos``; scores capped as
        ``softcap * tanh(s / softcap)``; head ``h``'s softmax denominator has
        ``exp(sinks[h])`` added."""
        heads, d = self.heads, self.q.shape[-1]
        kv_heads = self.k.shape[1]
        out = torch.empty(self.q.shape[0], heads * d, dtype=torch.float64)
        for i, (ctx, q_len) in enumerate(self.seqs):
            def key_val(pos: int, kvh: int, i: int = i, ctx: int = ctx) -> tuple:
                if pos >= ctx:  # written by this step
                    row = self.qsl[i] + pos - ctx
                    return self.k[row, kvh], self.v[row, kvh]
                blk, off = divmod(self.slot(i, pos), self.block_size)
                return self.k_cache[blk, kvh, :, off], self.v_cache[blk, kvh, off]
            for j in range(q_len):
                row, pos = self.qsl[i] + j, ctx + j
                for h in range(heads):
                    kvh = h // (heads // kv_heads)
                    first = 0 if window is None else max(0, pos - window + 1)
                    kv = [key_val(p, kvh) for p in range(first, pos + 1)]
                    keys = torch.stack([kk for kk, _ in kv]).double()
                    vals = torch.stack([vv for _, vv in kv]).double()
                    scores = keys @ self.q[row, h].double() / math.sqrt(d)
                    if softcap is not None:
                        scores = softcap * torch.tanh(scores / softcap)
                    if sinks is None:
                        probs = torch.softmax(scores, 0)
                    else:
                        e = torch.exp(scores - scores.max())
                        sink = torch.exp(sinks[h].double() - scores.max())
                        probs = e / (e.sum() + sink)
                    out[row, h * d:(h + 1) * d] = probs @ vals
        return out


CASES = [
    # (context, new tokens) per sequence, heads, kv_heads, block_size, head_dim
    ([(0, 1), (4, 1), (15, 1), (16, 1), (32, 1)], 9, 3, 16, 64),  # decodes; SmolLM2's heads
    ([(0, 7), (5, 1), (9, 6), (0, 1)], 4, 2, 4, 32),  # prompt, decode, chunk, 1-token prompt
    ([(39, 1), (0, 12), (3, 5)], 4, 4, 8, 16),  # no GQA
    ([(20, 20), (63, 1)], 6, 1, 16, 64),  # one kv head for all; chunk across blocks
    ([(30, 1), (0, 5), (17, 3)], 10, 2, 16, 128),  # head_dim 128 (Qwen); five heads per kv head
    ([(40, 2), (7, 1)], 4, 1, 32, 64),  # a block size the AVX-512 scorer does not take
    ([(0, 5), (0, 5), (0, 5)], 9, 3, 16, 64),  # only prompts of one length: SDPA's output as is
    # Decode, three equal prompts (one SDPA call), chunk, prompts of two lengths, decode.
    ([(3, 1), (0, 6), (0, 6), (0, 6), (10, 4), (0, 6), (0, 3), (8, 1)], 9, 3, 16, 64),
]


# Decodes over contexts longer than one span of the value walk (VALUE_SPAN, 256 positions),
# ending mid-block: (context, new tokens) per sequence, heads, kv_heads, block_size, head_dim.
LONG_CASES = [
    ([(300, 1), (530, 1), (17, 1)], 32, 4, 16, 128),  # eight query heads a kv head (Qwen3)
    ([(600, 1), (40, 3)], 24, 2, 16, 128),  # twelve: a tile of eight rows, then one of four
    ([(290, 1)], 4, 2, 16, 256),  # head_dim 256 (Gemma), two query heads a kv head
    ([(700, 1)], 6, 2, 16, 96),  # a head_dim the tiled walk does not take: the generic one
]


@needs_kernels
@pytest.mark.parametrize("case", range(len(LONG_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_paged_attention_over_long_contexts_matches_float64_oracle(
        case: int, dtype: torch.dtype) -> None:
    step = Step(100 + case, *LONG_CASES[case], dtype)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(step.run().double(), step.oracle(), atol=tol, rtol=tol)


def _force_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention.cpu_kernels, "supports", lambda dtype, device: False)


@needs_kernels
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_paged_attention_matches_float64_oracle(case: int, dtype: torch.dtype) -> None:
    step = Step(case, *CASES[case], dtype)
    got = step.run()
    assert got.dtype == dtype and got.shape == (step.q.shape[0], step.q.shape[1] * step.q.shape[2])
    # float32: summation order only; bfloat16: one rounding of the output.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), step.oracle(), atol=tol, rtol=tol)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_torch_paged_attention_matches_float64_oracle(
    case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force_torch_path(monkeypatch)
    step = Step(case, *CASES[case], torch.float32)
    torch.testing.assert_close(step.run().double(), step.oracle(), atol=1e-5, rtol=1e-5)


def test_kernel_split_sends_prompts_from_position_0_to_sdpa_in_runs_of_one_length() -> None:
    step = Step(0, *CASES[-1], torch.float32)
    fresh, ranges = step.meta.kernel_split()
    # (first row, prompts, length): rows 1-18 are three 6-token prompts, then one of 6, one of 3.
    assert fresh == [(1, 3, 6), (23, 1, 6), (29, 1, 3)]
    # Everything else stays with the C kernel: the decode, the chunk, the last decode.
    assert ranges == [(0, 1), (19, 23), (32, 33)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_cache_write_stores_what_the_torch_write_stores(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = Step(5, [(3, 4), (0, 9), (17, 1)], 4, 2, 8, 16, dtype)
    kc, vc = step.k_cache.clone(), step.v_cache.clone()
    cpu_kernels.kv_cache_write(step.k, step.v, step.meta.slot_mapping, kc, vc)
    kt, vt = step.k_cache.clone(), step.v_cache.clone()
    attention.write_kv(step.k, step.v, kt, vt, step.meta)
    assert torch.equal(kc, kt) and torch.equal(vc, vt)
    assert not torch.equal(kc, step.k_cache)  # something was written


@needs_kernels
def test_c_attention_reads_only_each_tokens_visible_positions() -> None:
    # Poison every cache position no token may see: blocks nobody owns, and the positions
    # past each sequence's end. A kernel reading past a token's causal limit, or through a
    # padded table entry, would produce NaN.
    step = Step(7, [(5, 1), (0, 16), (12, 8)], 4, 2, 8, 32, torch.float32)
    owned = {int(step.tables[i, j]) for i, (c, q) in enumerate(step.seqs)
             for j in range(-(-(c + q) // 8))}
    for blk in set(range(step.k_cache.shape[0])) - owned:
        step.k_cache[blk] = float("nan")
        step.v_cache[blk] = float("nan")
    for i, (c, q) in enumerate(step.seqs):
        end = c + q
        last = int(step.tables[i, (end - 1) // 8])
        step.k_cache[last, :, :, end % 8 or 8:] = float("nan")
        step.v_cache[last, :, end % 8 or 8:] = float("nan")
    got = step.run()
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), step.oracle(), atol=1e-5, rtol=1e-5)


# Sliding windows (and Gemma 2's score soft-capping): (case, window, softcap). Windows at,
# inside and across block edges; contexts shorter than the window too (window 40).
WINDOW_CASES = [(1, 4, None), (2, 7, None), (3, 16, 2.5), (4, 5, None), (5, 40, None),
                (7, 3, 1.5), (0, 16, None), (6, 2, None)]


def _window_ids() -> list[str]:
    return [f"case{c}-w{w}-cap{cap}" for c, w, cap in WINDOW_CASES]


@needs_kernels
@pytest.mark.parametrize(("case", "window", "softcap"), WINDOW_CASES, ids=_window_ids())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_sliding_window_attention_matches_float64_oracle(
        case: int, window: int, softcap: float | None, dtype: torch.dtype) -> None:
    step = Step(case, *CASES[case], dtype)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(step.run(window, softcap).double(),
                               step.oracle(window, softcap), atol=tol, rtol=tol)


@pytest.mark.parametrize(("case", "window", "softcap"), WINDOW_CASES, ids=_window_ids())
def test_torch_sliding_window_attention_matches_float64_oracle(
        case: int, window: int, softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    _force_torch_path(monkeypatch)
    step = Step(case, *CASES[case], torch.float32)
    torch.testing.assert_close(step.run(window, softcap).double(),
                               step.oracle(window, softcap), atol=1e-5, rtol=1e-5)


# Prompts from position 0 longer than their window, in SDPA calls of a few query rows over
# their windows' keys: (seqs, window, query rows per call). Blocks that end mid-window,
# at its edge, and a last block shorter than the others; a run of two equal prompts (one
# call per block for both); a prompt beside a decode and a chunk (the C kernel's).
BANDED_CASES = [([(0, 23)], 5, 3), ([(0, 20), (0, 20)], 7, 4), ([(0, 17)], 4, 4),
                ([(2, 1), (0, 19), (6, 3)], 6, 5), ([(0, 16)], 15, 16)]


@needs_kernels
@pytest.mark.parametrize("case", range(len(BANDED_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_prompts_attend_in_query_blocks_over_their_windows(
        case: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    seqs, window, rows = BANDED_CASES[case]
    monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", rows)
    step = Step(30 + case, seqs, 4, 2, 4, 32, dtype)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(step.run(window).double(), step.oracle(window),
                               atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize(("case", "window"), [(c, None) for c in range(len(CASES))]
                         + [(c, w) for c, w, cap in WINDOW_CASES if cap is None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_with_context_attend_a_copy_of_it_in_sdpa(
        case: int, window: int | None, dtype: torch.dtype,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks with earlier context of 2 tokens and more (normally 128) go to SDPA over their
    gathered keys, in calls of 3 query rows, beside the C kernel's decodes and SDPA's
    fresh prompts in one step; with a window, back to the C kernel."""
    monkeypatch.setattr(attention, "CONTEXT_CHUNK_MIN_TOKENS", 2)
    monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", 3)
    step = Step(case, *CASES[case], dtype)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(step.run(window).double(), step.oracle(window),
                               atol=tol, rtol=tol)


def test_kernel_split_sends_long_chunks_with_context_to_sdpa(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "CONTEXT_CHUNK_MIN_TOKENS", 4)
    # decode, chunk of 6 over 9, prompt, chunk of 3 over 5 (short: the kernel's), decode.
    step = Step(0, [(3, 1), (9, 6), (0, 5), (5, 3), (8, 1)], 4, 2, 4, 16, torch.float32)
    fresh, ranges = step.meta.kernel_split()
    assert fresh == [(7, 1, 5)]
    assert step.meta.long_context_chunks() == [(1, 7, 1, 15)]
    assert ranges == [(0, 1), (12, 16)]


@pytest.mark.parametrize("path", ["c", "torch"])
def test_sliding_window_attention_never_reads_blocks_before_the_window(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block that holds only positions before the earliest window of its sequence's
    tokens this step is NaN (what a freed, reused block may hold): the output stays
    finite and right."""
    if path == "torch":
        _force_torch_path(monkeypatch)
    elif cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    window, bs = 5, 4
    step = Step(11, [(30, 1), (21, 6), (0, 9), (13, 1)], 4, 2, bs, 16, torch.float32)
    for i, (ctx, _) in enumerate(step.seqs):
        for j in range(max(0, ctx - window + 1) // bs):
            blk = int(step.tables[i, j])
            step.k_cache[blk] = float("nan")
            step.v_cache[blk] = float("nan")
    got = step.run(window)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), step.oracle(window), atol=1e-5, rtol=1e-5)


# gpt-oss's attention sinks, with and without a window: (case, window).
SINK_CASES = [(1, None), (3, 16), (4, 5), (7, None), (7, 3)]


@pytest.mark.parametrize("path", ["c-f32", "c-bf16", "torch"])
@pytest.mark.parametrize(("case", "window"), SINK_CASES)
def test_attention_sinks_match_float64_oracle(case: int, window: int | None, path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "torch":
        _force_torch_path(monkeypatch)
    elif cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    dtype = torch.bfloat16 if path == "c-bf16" else torch.float32
    step = Step(case, *CASES[case], dtype)
    # Sinks around the scores' size, large enough to take most of some heads' mass.
    sinks = torch.linspace(-3.0, 4.0, step.heads, dtype=dtype)
    got = step.run(window, None, sinks).double()
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, step.oracle(window, None, sinks), atol=tol, rtol=tol)
    # The sinks take a visible share: the output differs from sink-free attention.
    assert (got - step.oracle(window)).abs().max() > 0.05
