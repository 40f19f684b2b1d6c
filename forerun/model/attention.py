"""Attention over a paged KV cache for a flat, mixed batch of prefill chunks and decodes.

Layout: the step's T scheduled tokens are concatenated; sequence ``i`` owns the rows
``query_start_loc[i]:query_start_loc[i + 1]``, which are its last ``q_len`` positions
(``seq_lens[i] - q_len`` … ``seq_lens[i] - 1``).  A token at position ``p`` of a sequence
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

Each layer's cache is a pair of tensors (see :func:`new_kv_cache`), head-major inside a
block, so one (block, head) pair is a contiguous run of ``block_size * head_dim`` values:
V is ``[num_blocks, num_kv_heads, block_size, head_dim]``, K is
``[num_blocks, num_kv_heads, head_dim, block_size]`` (each block's keys dimension-major).
Whole runs make the reads of a sequence's context long and sequential; the transposed keys
let the C kernel score a whole block with vertical multiply-adds (one vector lane per key)
instead of a horizontal reduction per key, which made decode attention about 2x faster.

On CPU (float32/bfloat16) each layer makes two C calls (forerun/model/cpu_kernels.py): one
stores the new K/V rows in their slots, one attends the step's query tokens over their paged
context straight from the cache, decodes and prefill chunks with earlier context alike.
Prompt chunks that start at position 0 have no context but their own new rows; those go to
SDPA instead, one call per run of adjacent chunks of one length (on a sliding layer, one
call per block of queries over their windows' keys), and so do chunks of 128 tokens or more
with earlier context on a layer without a window, over a gathered copy of their context. Elsewhere, or where
the kernels could not be built, the torch path below computes the same function: decodes in
one batched gather + matmul call, prefill chunks with SDPA one sequence at a time.

A sliding-window layer (``window`` W) lets the token at position ``p`` attend to positions
``p - W + 1 … p`` (transformers' convention), and Gemma 2 soft-caps the scaled scores
(``softcap``): both paths take them per call. The C kernel starts each token's walk at the
block holding its window's first position; the torch path gathers from that block on (a
window view of the step's metadata, built once per step and window), so blocks wholly
before a window are never read: the KV cache manager may free them.

gpt-oss's attention sinks (``sinks``, one learned logit per query head) join each softmax's
denominator only. SDPA cannot add them, so with sinks every token goes to the C kernel, and
the torch path computes its scores explicitly (as for soft-capping).

A quantized cache (``kv_cache_dtype`` int8 / fp8, :mod:`forerun.model.kv_quant`) adds a
float32 scale per (block, kv head) for K and for V: the layer's cache is then
``(k, v, k_scale, v_scale)`` and ``paged_attention`` takes the scales as ``kv_scales``. The C
kernels dequantize inside their dot products; the torch path dequantizes only the runs it
gathers. Prompt chunks with no earlier context attend to their own rows as the cache holds
them (read back, dequantized), so every path sees the same keys and values.

Everything that depends only on the batch shape (gather indices, masks) is computed once per
step, by ``AttentionMetadata`` on the first layer's request (the torch path's indices and
masks only if that path runs), so that the per-layer path is a handful of tensor ops with no
host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from forerun.model import cpu_kernels, kv_quant

# (K, V), or (K, V, K scales, V scales) for a quantized cache.
KVCache = tuple[torch.Tensor, ...]


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 cache_dtype: torch.dtype | None = None) -> KVCache:
    """One layer's zeroed (K, V) cache pair in the layout described above, in ``dtype``
    unless ``cache_dtype`` says otherwise; a 1-byte ``cache_dtype`` (int8, fp8) adds the
    float32 scales ``[num_blocks, num_kv_heads]`` of K and of V."""
    store = dtype if cache_dtype is None else cache_dtype
    k = torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=store, device=device)
    v = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=store, device=device)
    if not kv_quant.is_quantized(store):
        return k, v
    scales = torch.zeros(2, num_blocks, num_kv_heads, dtype=torch.float32, device=device)
    return k, v, scales[0], scales[1]


def _head_runs(blocks: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Run indices into the ``[num_blocks * KVH, block_size * D]`` cache view, ordered
    (..., head, block) so that the gathered runs form ``[..., KVH, n_blocks * block_size, D]``."""
    heads = torch.arange(num_kv_heads, device=blocks.device)
    runs = blocks.unsqueeze(-2) * num_kv_heads + heads.view(num_kv_heads, 1)
    return runs.reshape(-1)


@dataclass(slots=True)
class PrefillSpan:
    """One sequence with more than one query token in this step (a prompt or a chunk of one)."""

    seq: int  # row of block_tables
    start: int
    end: int
    seq_len: int
    # Blocks holding all ``seq_len`` context positions; None when the chunk starts at position
    # 0, because then the new K/V rows already are the whole context.
    context_blocks: torch.Tensor | None
    # [q_len, seq_len] bool causal mask offset by the earlier context; None means plain causal.
    mask: torch.Tensor | None
    # Gather indices of the context runs, built by the first layer (needs the head count).
    context_runs: torch.Tensor | None = None
    # Position of the first gathered context key (a sliding window starts past 0).
    context_start: int = 0


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step description of the flat batch; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    block_size: int
    num_tokens: int = 0
    # Decode part (q_len == 1): rows in the flat batch, either a contiguous range or an index.
    decode_row_range: tuple[int, int] | None = None
    decode_rows: torch.Tensor | None = None
    # [B_dec, n_blocks] blocks covering every decode sequence's context (padded with block 0).
    decode_blocks: torch.Tensor | None = None
    # Context length the decode gather produces: n_blocks * block_size.
    decode_max_ctx: int = 0
    # [B_dec, 1, 1, max_ctx] True where a gathered position is real context; None if none
    # is padding.
    decode_mask: torch.Tensor | None = None
    # Gather indices of the decode context runs; built by the first layer.
    decode_runs: torch.Tensor | None = None
    # Where this step's new K/V go (torch path): V rows of the [num_blocks * KVH *
    # block_size, D] view in (token, head) order, and K elements of the flat cache in
    # (token, head, dim) order; built by the first layer.
    write_rows: torch.Tensor | None = None
    write_k_elems: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Sequences with a single query token (decodes), in batch order.
    decode_seq_idx: list[int] = field(default_factory=list)
    torch_path_ready: bool = False
    # For the C kernel, per query token: its row in block_tables and how many context
    # positions it sees (its position + 1); built on first use.
    token_seq: torch.Tensor | None = None
    token_len: torch.Tensor | None = None
    # For the C kernel path: runs of adjacent prompt chunks that start at position 0 and
    # have one length, as (first row, count, length), and the row ranges of every other
    # token; built on first use.
    fresh_runs: list[tuple[int, int, int]] | None = None
    kernel_ranges: list[tuple[int, int]] | None = None
    # Prefill chunks with earlier context and at least CONTEXT_CHUNK_MIN_TOKENS tokens, as
    # (first row, end row, row of block_tables, seq_len): SDPA over a copy of their context
    # on a layer without a sliding window.
    context_chunks: list[tuple[int, int, int, int]] | None = None
    # A sliding layer's C-kernel ranges: kernel_ranges with the long chunks merged back in
    # (sliding layers keep those in the kernel), built on first use.
    window_kernel_ranges: list[tuple[int, int]] | None = None
    # A window view's window (torch path of a sliding layer): keys before it are neither
    # gathered nor attended. Views by window, built on first use (:meth:`windowed`).
    window: int | None = None
    window_views: dict[int, AttentionMetadata] = field(default_factory=dict)
    # Masks of the query blocks SDPA attends in (fresh prompts on sliding layers, long
    # chunks with context), by (queries, keys, offset of the first query past the first
    # key, window).
    window_masks: dict[tuple[int, int, int, int], torch.Tensor] = field(default_factory=dict)
    # Several KV cache groups (docs/kv_cache.md): this is group 0's; per layer, its group's
    # metadata (the same batch over that group's block table and slots), None for group 0.
    layer_metas: list[AttentionMetadata | None] | None = None
    # Another group's metadata of the same batch: token_indices and kernel_split are its.
    same_batch_as: AttentionMetadata | None = None

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with (its KV cache group's)."""
        metas = self.layer_metas
        if metas is None:
            return self
        meta = metas[layer]
        return self if meta is None else meta

    def windowed(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this sliding ``window`` reads in the torch path (self
        when no sequence is longer than the window)."""
        if window is None or max(self.seq_lens) <= window:
            return self
        view = self.window_views.get(window)
        if view is None:
            view = AttentionMetadata.build(self.query_start_loc, self.seq_lens,
                                           self.block_tables, self.slot_mapping,
                                           self.block_size, self.block_tables.device)
            view.window = window
            self.window_views[window] = view
        return view

    def window_mask(self, q_len: int, k_len: int, offset: int, window: int) -> torch.Tensor:
        """``[q_len, k_len]`` bool for queries ``offset`` positions past the first key:
        causal, and fewer than ``window`` positions back."""
        key = (q_len, k_len, offset, window)
        mask = self.window_masks.get(key)
        if mask is None:
            mask = _window_mask(q_len, k_len, offset, 0, window, self.block_tables.device)
            self.window_masks[key] = mask
        return mask

    def token_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_seq, token_len)`` for :func:`cpu_kernels.paged_attention`."""
        if (self.token_seq is None or self.token_len is None) \
                and self.same_batch_as is not None:
            self.token_seq, self.token_len = self.same_batch_as.token_indices()
        if self.token_seq is None or self.token_len is None:
            qsl = np.asarray(self.query_start_loc, dtype=np.int64)
            q_lens = np.diff(qsl)
            first = np.asarray(self.seq_lens, dtype=np.int64) - q_lens + 1
            seq = np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)
            offset = np.arange(self.num_tokens, dtype=np.int64) - np.repeat(qsl[:-1], q_lens)
            device = self.block_tables.device
            self.token_seq = torch.from_numpy(seq).to(device)
            self.token_len = torch.from_numpy(np.repeat(first, q_lens) + offset).to(device)
        return self.token_seq, self.token_len

    def kernel_split(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """``(fresh_runs, kernel_ranges)``: the prompt chunks with no earlier context, in
        runs of one length, and the row ranges of the tokens for the C kernel (decodes,
        short chunks); long chunks with context are :meth:`long_context_chunks`."""
        if (self.fresh_runs is None or self.kernel_ranges is None
                or self.context_chunks is None) and self.same_batch_as is not None:
            self.fresh_runs, self.kernel_ranges = self.same_batch_as.kernel_split()
            self.context_chunks = self.same_batch_as.long_context_chunks()
        if self.fresh_runs is None or self.kernel_ranges is None or self.context_chunks is None:
            runs: list[tuple[int, int, int]] = []
            ranges: list[tuple[int, int]] = []
            chunks: list[tuple[int, int, int, int]] = []
            row = 0
            for span in self.prefills:
                q_len = span.end - span.start
                fresh = span.seq_len == q_len
                if not fresh and q_len < CONTEXT_CHUNK_MIN_TOKENS:
                    continue
                if span.start > row:
                    ranges.append((row, span.start))
                row = span.end
                if not fresh:
                    chunks.append((span.start, span.end, span.seq, span.seq_len))
                elif runs and runs[-1][0] + runs[-1][1] * runs[-1][2] == span.start \
                        and runs[-1][2] == q_len:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1, q_len)
                else:
                    runs.append((span.start, 1, q_len))
            if row < self.num_tokens:
                ranges.append((row, self.num_tokens))
            self.fresh_runs, self.kernel_ranges, self.context_chunks = runs, ranges, chunks
        return self.fresh_runs, self.kernel_ranges

    def long_context_chunks(self) -> list[tuple[int, int, int, int]]:
        """The prefill chunks with earlier context that :func:`paged_attention` gives to
        SDPA (see ``context_chunks``)."""
        self.kernel_split()
        assert self.context_chunks is not None
        return self.context_chunks

    def sliding_kernel_ranges(self) -> list[tuple[int, int]]:
        """The C kernel's row ranges on a sliding layer: :meth:`kernel_split`'s with the long
        chunks with context among them, once per step."""
        if self.window_kernel_ranges is None:
            _, ranges = self.kernel_split()
            self.window_kernel_ranges = sorted(
                ranges + [(c[0], c[1]) for c in self.long_context_chunks()])
        return self.window_kernel_ranges

    @classmethod
    def build(
        cls,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Precompute gather indices and masks for a step (python lists in, device tensors out)."""
        if len(query_start_loc) != len(seq_lens) + 1:
            raise ValueError("query_start_loc must have one more entry than seq_lens")
        block_tables = block_tables.to(device=device, dtype=torch.long, non_blocking=True)
        meta = cls(
            slot_mapping=slot_mapping.to(device=device, dtype=torch.long, non_blocking=True),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=block_size,
            num_tokens=query_start_loc[-1],
        )
        dec_idx: list[int] = []
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            q_len = end - start
            if q_len <= 0:
                raise ValueError(f"sequence {i} has no query tokens")
            if q_len > seq_len:
                raise ValueError(f"sequence {i}: query length {q_len} > seq_len {seq_len}")
            if q_len == 1:
                dec_idx.append(i)
            else:
                meta.prefills.append(PrefillSpan(i, start, end, seq_len, None, None))
        meta.decode_seq_idx = dec_idx
        return meta

    def build_torch_path(self) -> None:
        """Gather indices and masks of the pure-torch path; built once per step, and only
        when that path runs (the C kernels need none of it)."""
        if self.torch_path_ready:
            return
        self.torch_path_ready = True
        device = self.block_tables.device
        w, bs = self.window, self.block_size
        for span in self.prefills:
            q_len = span.end - span.start
            ctx = span.seq_len - q_len
            if w is not None and span.seq_len > w:
                # From the block of the first query's first visible key on.
                first_block = max(0, ctx - w + 1) // bs if ctx > 0 else 0
                span.context_start = first_block * bs
                if ctx > 0:
                    span.context_blocks = self.block_tables[
                        span.seq, first_block: -(-span.seq_len // bs)]
                span.mask = _window_mask(q_len, span.seq_len - span.context_start, ctx,
                                         span.context_start, w, device)
            elif ctx > 0:
                span.context_blocks = self.block_tables[span.seq, : -(-span.seq_len // bs)]
                span.mask = torch.ones(q_len, span.seq_len, dtype=torch.bool,
                                       device=device).tril(ctx)
        if self.decode_seq_idx:
            self._build_decode(self.decode_seq_idx, device)

    def _build_decode(self, dec_idx: list[int], device: torch.device) -> None:
        rows = [self.query_start_loc[i] for i in dec_idx]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            self.decode_row_range = (rows[0], rows[0] + len(rows))
        else:
            self.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
        lens_list = [self.seq_lens[i] for i in dec_idx]
        bs = self.block_size
        if len(dec_idx) == self.block_tables.shape[0]:
            tables = self.block_tables
        else:
            tables = self.block_tables.index_select(
                0, torch.tensor(dec_idx, dtype=torch.long, device=device))
        if self.window is not None:
            self._build_window_decode(lens_list, tables, self.window, device)
            return
        n_blocks = -(-max(lens_list) // bs)
        self.decode_blocks = tables[:, :n_blocks]
        self.decode_max_ctx = n_blocks * bs
        if min(lens_list) != self.decode_max_ctx:
            pos = torch.arange(self.decode_max_ctx, device=device)
            lens = torch.tensor(lens_list, dtype=torch.long, device=device)
            self.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]


    def _build_window_decode(self, lens_list: list[int], tables: torch.Tensor, window: int,
                             device: torch.device) -> None:
        """Each decode gathers from the block of its window's first position on; the
        gathers have one width (the widest), the positions outside the window masked."""
        bs = self.block_size
        firsts = [max(0, n - window) for n in lens_list]
        starts = [f // bs for f in firsts]
        n_blocks = max(-(-n // bs) - s for n, s in zip(lens_list, starts, strict=True))
        cols = torch.tensor(starts, dtype=torch.long, device=device)[:, None] + torch.arange(
            n_blocks, device=device)
        # Columns past a sequence's last block only pad (masked): they repeat that block, a
        # live one, so that no freed block is read.
        last = torch.tensor([-(-n // bs) - 1 for n in lens_list], dtype=torch.long,
                            device=device)[:, None]
        self.decode_blocks = tables.gather(1, torch.minimum(cols, last))
        self.decode_max_ctx = n_blocks * bs
        pos = (torch.tensor(starts, dtype=torch.long, device=device)[:, None] * bs
               + torch.arange(self.decode_max_ctx, device=device))
        lo = torch.tensor(firsts, dtype=torch.long, device=device)[:, None]
        hi = torch.tensor(lens_list, dtype=torch.long, device=device)[:, None]
        self.decode_mask = ((pos >= lo) & (pos < hi))[:, None, None, :]


def _window_mask(q_len: int, k_len: int, q_start: int, k_start: int, window: int,
                 device: torch.device) -> torch.Tensor:
    """``[q_len, k_len]`` bool for queries at positions ``q_start + i`` and keys at
    ``k_start + j``: causal, and fewer than ``window`` positions back."""
    q = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    return (k <= q) & (k > q - window)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of float32 ``scores``, with ``exp(sink)`` added to
    each row's denominator when ``sinks`` is given (shaped to broadcast to
    ``scores[..., :1]``: one logit per query head)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None, causal: bool, scale: float,
                      softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA's function over ``[B, H, Q, D]`` / ``[B, KVH, K, D]``, with the scaled scores
    soft-capped (``softcap * tanh(s / softcap)``) when ``softcap`` is set and attention
    sinks ``[H]`` in the softmax when ``sinks`` is: SDPA can do neither."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                          device=q.device).tril(k.shape[-2] - q.shape[-2])
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    sink = None if sinks is None else sinks.view(-1, 1, 1)  # [H] -> [H, Q, 1]
    return torch.matmul(_softmax_with_sinks(scores, sink).to(v.dtype), v)


def _write_indices(v_cache: torch.Tensor, meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(write_rows, write_k_elems)`` of the step (see :class:`AttentionMetadata`)."""
    kvh, bs, d = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    if meta.write_rows is None or meta.write_k_elems is None:
        slots = meta.slot_mapping
        heads = torch.arange(kvh, device=slots.device)
        blk_head = ((slots // bs) * kvh).unsqueeze(1) + heads  # [T, KVH]
        off = (slots % bs).unsqueeze(1)
        meta.write_rows = (blk_head * bs + off).reshape(-1)
        dims = torch.arange(d, device=slots.device)
        meta.write_k_elems = ((blk_head.unsqueeze(2) * d + dims) * bs + off.unsqueeze(2)).reshape(-1)
    return meta.write_rows, meta.write_k_elems


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store this step's K/V rows ``[T, KVH, D]`` in their cache slots (torch path);
    quantized, with the cache's scales ``kv_scales``."""
    d = v_cache.shape[3]
    rows, k_elems = _write_indices(v_cache, meta)
    if kv_scales is not None:
        kv_quant.write_kv_quantized(k, v, k_cache, v_cache, kv_scales[0], kv_scales[1],
                                    meta.slot_mapping, rows, k_elems)
        return
    k_cache.view(-1).index_copy_(0, k_elems, k.reshape(-1))
    v_cache.view(-1, d).index_copy_(0, rows, v.reshape(-1, d))


def _read_back(k_cache: torch.Tensor, v_cache: torch.Tensor,
               kv_scales: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's K/V rows as a quantized cache holds them (dequantized to ``dtype``)."""
    rows, k_elems = _write_indices(v_cache, meta)
    return kv_quant.read_rows(k_cache, v_cache, kv_scales[0], kv_scales[1], meta.slot_mapping,
                              rows, k_elems, dtype)


def decode_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """All single-token queries of the step in one call, from tensor ops: gather the
    context densely, then two matmuls (or SDPA off the CPU); returns [B_dec, H, D]."""
    assert meta.decode_blocks is not None
    b, num_heads, d = q.shape  # b == len(meta.decode_seq_idx)
    kvh, bs = v_cache.shape[1], v_cache.shape[2]
    k_runs = k_cache.view(-1, bs * d)
    v_runs = v_cache.view(-1, bs * d)
    ctx = meta.decode_max_ctx
    # With one query token, the G query heads that share a KV head can act as G query rows
    # of that KV head: no K/V expansion and no GQA support needed from the kernel.
    qg = q.view(b, kvh, num_heads // kvh, d)
    if meta.decode_runs is None:
        meta.decode_runs = _head_runs(meta.decode_blocks, kvh)
    # index_select of whole (block, head) runs is several times faster than advanced
    # indexing, and far faster than per-slot rows.
    # Keys arrive [B, KVH, n_blocks, D, bs]: one copy makes them [B, KVH, D, ctx], the
    # right-hand side of q @ k^T.
    if kv_scales is None:
        kt = k_runs.index_select(0, meta.decode_runs)
        v = v_runs.index_select(0, meta.decode_runs)
    else:  # dequantized as gathered: only the context's runs
        kt = kv_quant.gather_runs(k_cache, kv_scales[0], meta.decode_runs, q.dtype)
        v = kv_quant.gather_runs(v_cache, kv_scales[1], meta.decode_runs, q.dtype)
    kt = kt.view(b, kvh, ctx // bs, d, bs).permute(0, 1, 3, 2, 4).reshape(b, kvh, d, ctx)
    v = v.view(b, kvh, ctx, d)
    if q.device.type != "cpu" and softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qg, kt.transpose(-1, -2), v,
                                             attn_mask=meta.decode_mask, scale=scale)
        return out.view(b, num_heads, d)
    # One query row per head: two plain matmuls beat the CPU flash kernel (about 2x in
    # bf16 at 64 sequences x 256 context); scores and softmax stay in float32.
    scores = torch.matmul(qg, kt).float().mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    if meta.decode_mask is not None:
        scores.masked_fill_(~meta.decode_mask, float("-inf"))
    # Query head h = kv head * G + g, as the scores' [KVH, G] rows.
    sink = None if sinks is None else sinks.view(kvh, num_heads // kvh, 1)
    out = torch.matmul(_softmax_with_sinks(scores, sink).to(v.dtype), v)
    return out.view(b, num_heads, d)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_runs: torch.Tensor,
    v_runs: torch.Tensor, span: PrefillSpan, scale: float, softcap: float | None = None,
    sinks: torch.Tensor | None = None, caches: KVCache | None = None,
) -> torch.Tensor:
    """Causal attention for one prefill chunk; returns [q_len, H, D]. ``caches`` (a
    quantized layer cache) makes the context runs dequantized as they are gathered."""
    qs = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
    kvh, d = k.shape[1], k.shape[2]
    if span.context_blocks is None:
        ks = k[span.start:span.end].transpose(0, 1).unsqueeze(0)
        vs = v[span.start:span.end].transpose(0, 1).unsqueeze(0)
    else:
        if span.context_runs is None:
            span.context_runs = _head_runs(span.context_blocks, kvh)
        if caches is None:
            kt = k_runs.index_select(0, span.context_runs)
            vt = v_runs.index_select(0, span.context_runs)
        else:
            kt = kv_quant.gather_runs(caches[0], caches[2], span.context_runs, q.dtype)
            vt = kv_quant.gather_runs(caches[1], caches[3], span.context_runs, q.dtype)
        kt = kt.view(kvh, -1, d, k_runs.shape[1] // d)
        n_keys = span.seq_len - span.context_start
        ks = kt.transpose(-1, -2).reshape(1, kvh, -1, d)[:, :, :n_keys]
        vs = vt.view(1, kvh, -1, d)[:, :, :n_keys]
    out = _capped_attention(qs, ks, vs, span.mask, span.mask is None, scale, softcap, sinks)
    return out.squeeze(0).transpose(0, 1)


# Query rows per SDPA call of a sliding-window prompt (see _fresh_prompt_attention). Each
# call reads its rows' keys only, from ``window - 1`` before its first row, so a prompt of T
# tokens costs about T * (window + 128) scores instead of T * T. Process CPU time over 2048
# tokens (bf16, Gemma 3 1B's heads, window 512, one Zen 5 core): 0.085 s at 128 rows, 0.082 s
# at 256, 0.10 s at 512, 0.24 s in one masked call; fewer rows read fewer keys per query.
WINDOW_QUERY_BLOCK = 128


def _fresh_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                            count: int, length: int, scale: float, window: int | None = None,
                            meta: AttentionMetadata | None = None) -> torch.Tensor:
    """Causal attention of ``count`` adjacent prompt chunks of ``length`` tokens that start
    at position 0, so their new K/V rows are their whole context; returns
    ``[count * length, H, D]``. A sliding ``window`` shorter than ``length`` limits each
    query to its last ``window`` positions (its masks cached on ``meta``).

    The C kernel walks each query's context row by row, which suits a decode; a prompt's
    queries all read the same keys, and SDPA's tiled kernel computes them as matrix products,
    about 4x faster for a batch of 128-token prompts in bf16 on a 2-core CPU."""
    end = start + count * length
    heads = lambda x: x[start:end].unflatten(0, (count, length)).transpose(1, 2)  # noqa: E731
    gqa = q.shape[1] != k.shape[1]
    num_heads, d = q.shape[1], q.shape[2]
    if _tiled_prompt_kernel(q, k):
        return cpu_kernels.prompt_attention(q[start:end], k[start:end], v[start:end], count,
                                            length, length, scale, window)
    if window is None or length <= window:
        out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True,
                                             scale=scale, enable_gqa=gqa)
        # SDPA lays its output out token-major, so this is a view, not a copy.
        return out.transpose(1, 2).reshape(count * length, num_heads, d)
    # One masked call over the whole prompt would score every key of every query and skip
    # no tile (a mask hides nothing from SDPA's tiling); blocks of queries over their
    # windows' keys score about window + block keys per query.
    assert meta is not None
    qh, kh, vh = heads(q), heads(k), heads(v)
    out = q.new_empty(count, length, num_heads, d)
    for lo in range(0, length, WINDOW_QUERY_BLOCK):
        hi = min(length, lo + WINDOW_QUERY_BLOCK)
        k_lo = max(0, lo - window + 1)
        mask = meta.window_mask(hi - lo, hi - k_lo, lo - k_lo, window)
        part = F.scaled_dot_product_attention(qh[:, :, lo:hi], kh[:, :, k_lo:hi],
                                              vh[:, :, k_lo:hi], attn_mask=mask,
                                              scale=scale, enable_gqa=gqa)
        out[:, lo:hi] = part.transpose(1, 2)
    return out.view(count * length, num_heads, d)


# Prefill chunks with earlier context of at least this many tokens, on a layer without a
# sliding window, attend over a dense copy of their context in SDPA calls of
# WINDOW_QUERY_BLOCK query rows; shorter ones go to the C kernel with the decodes. The kernel
# walks every (token, kv head) pair's keys in float32, SDPA's tiles run as matrix products:
# a 2048-token chunk after 6144 tokens took 1.38 s in the kernel and 0.93 s here (bf16,
# Gemma 3 1B's heads, one Zen 5 core); after 2048 tokens both 0.38 s, and at 128 tokens
# 0.022 s against 0.020 s. Over a window of 512 the kernel's short walks were faster
# (0.062 s against 0.084 s), so sliding layers keep it.
CONTEXT_CHUNK_MIN_TOKENS = 128


def _context_chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, chunk: tuple[int, int, int, int],
                             scale: float, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                             ) -> torch.Tensor:
    """Causal attention of one prefill chunk (rows ``start:end``, block-table row ``seq``,
    context ``seq_len`` with the chunk) over its keys as the cache holds them (the step's
    rows already written there); returns ``[end - start, H, D]``."""
    start, end, seq, seq_len = chunk
    q_len, num_heads, d = end - start, q.shape[1], q.shape[2]
    kvh, bs = k_cache.shape[1], k_cache.shape[3]
    ctx = seq_len - q_len
    n_blocks = -(-seq_len // bs)
    runs = _head_runs(meta.block_tables[seq, :n_blocks], kvh)
    if kv_scales is None:
        kt = k_cache.view(-1, d * bs).index_select(0, runs)
        vt = v_cache.view(-1, bs * d).index_select(0, runs)
    else:
        kt = kv_quant.gather_runs(k_cache, kv_scales[0], runs, q.dtype)
        vt = kv_quant.gather_runs(v_cache, kv_scales[1], runs, q.dtype)
    keys = kt.view(1, kvh, n_blocks, d, bs).transpose(-1, -2).reshape(1, kvh, -1, d)
    vals = vt.view(1, kvh, n_blocks * bs, d)
    if _tiled_prompt_kernel(q, keys[0].transpose(0, 1)):
        # (reshape returns a view, dimension-major, when the context is one block)
        return cpu_kernels.prompt_attention(q[start:end],
                                            keys[0, :, :seq_len].contiguous().transpose(0, 1),
                                            vals[0, :, :seq_len].transpose(0, 1), 1, q_len,
                                            seq_len, scale)
    qh = q[start:end].transpose(0, 1).unsqueeze(0)
    out = q.new_empty(q_len, num_heads, d)
    for lo in range(0, q_len, WINDOW_QUERY_BLOCK):
        hi = min(q_len, lo + WINDOW_QUERY_BLOCK)
        # Causal: a "window" longer than the sequence.
        mask = meta.window_mask(hi - lo, ctx + hi, ctx + lo, seq_len + 1)
        part = F.scaled_dot_product_attention(qh[:, :, lo:hi], keys[:, :, :ctx + hi],
                                              vals[:, :, :ctx + hi], attn_mask=mask,
                                              scale=scale, enable_gqa=num_heads != kvh)
        out[lo:hi] = part[0].transpose(0, 1)
    return out


def _tiled_prompt_kernel(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether csrc/prompt_attention.c takes these prompt rows (``[T, H, D]``, keys ``[T, KVH,
    D]``): bfloat16 on a CPU with AVX512-BF16 but not AMX, head sizes a multiple of 32 up to
    256. Its two tiled bf16 products ran a 512-token prompt of a Llama-3.2-1B layer's heads
    5-6x faster than SDPA without AMX (3.0 against 17.3 ms on 2 cores); with AMX, torch's
    SDPA runs its tiles there and is the faster one (1B heads: 3.5 against 7.0 ms at 512
    tokens, 31 against 113 at 2048; Qwen3-30B-A3B's: 4.2 against 13.0, 47 against 203)."""
    d, num_heads, kvh = q.shape[2], q.shape[1], k.shape[1]
    return (d % 32 == 0 and d <= 256 and num_heads % kvh == 0 and num_heads // kvh <= 64
            and cpu_kernels.has_prompt_attention(q.dtype)
            and not cpu_kernels.small_matmul_has_amx())


def _use_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if not cpu_kernels.supports(q.dtype, q.device):
        return False
    # Heads contiguous inside each token's row, K and V rows equally far apart.
    return all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v)) and (
        k.stride(0) == v.stride(0))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Write k/v ([T, KVH, D]) into the cache, then attend q ([T, H, D]); returns [T, H*D].

    ``window``: a sliding-window layer's (each token sees its last ``window`` positions);
    ``softcap``: scaled scores become ``softcap * tanh(score / softcap)``; ``sinks`` ``[H]``:
    gpt-oss's per-head logits in each softmax's denominator; ``kv_scales``: a quantized
    cache's (K scales, V scales), None (or empty) for the model dtype."""
    t, num_heads, d = q.shape
    scales = (kv_scales[0], kv_scales[1]) if kv_scales else None
    if _use_kernels(q, k, v):
        cpu_kernels.kv_cache_write(k, v, meta.slot_mapping, k_cache, v_cache, scales)
        fresh, ranges = meta.kernel_split()
        chunks = meta.long_context_chunks()
        if window is not None and chunks:  # see CONTEXT_CHUNK_MIN_TOKENS
            ranges, chunks = meta.sliding_kernel_ranges(), []
        if softcap is not None or sinks is not None:  # SDPA cannot: all to the C kernel
            fresh, ranges, chunks = [], [(0, t)], []
        if fresh and scales is not None:  # fresh prompts read their rows as stored
            k, v = _read_back(k_cache, v_cache, scales, meta, q.dtype)
        if not ranges and not chunks and len(fresh) == 1:  # prompts of one length: no copy
            start, count, length = fresh[0]
            return _fresh_prompt_attention(q, k, v, start, count, length, scale, window,
                                           meta).reshape(t, num_heads * d)
        token_seq, token_len = meta.token_indices()
        if not fresh and not chunks:
            out = cpu_kernels.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                              token_seq, token_len, scale, None, window,
                                              softcap, sinks, scales)
            return out.view(t, num_heads * d)
        out = q.new_empty(t, num_heads, d)
        for lo, hi in ranges:
            cpu_kernels.paged_attention(q[lo:hi], k_cache, v_cache, meta.block_tables,
                                        token_seq[lo:hi], token_len[lo:hi], scale, out[lo:hi],
                                        window, softcap, sinks, scales)
        for start, count, length in fresh:
            out[start:start + count * length] = _fresh_prompt_attention(
                q, k, v, start, count, length, scale, window, meta)
        for chunk in chunks:
            out[chunk[0]:chunk[1]] = _context_chunk_attention(q, k_cache, v_cache, meta, chunk,
                                                              scale, scales)
        return out.view(t, num_heads * d)
    meta = meta.windowed(window)
    meta.build_torch_path()
    write_kv(k, v, k_cache, v_cache, meta, scales)
    if not meta.prefills and meta.decode_row_range == (0, t):
        # Pure decode step (the common case): no scatter into a separate output.
        return decode_attention_torch(q, k_cache, v_cache, meta, scale, softcap,
                                      sinks, scales).reshape(t, num_heads * d)
    caches = None
    if scales is not None:
        caches = (k_cache, v_cache, *scales)
        if any(span.context_blocks is None for span in meta.prefills):
            k, v = _read_back(k_cache, v_cache, scales, meta, q.dtype)
    # [num_blocks * KVH, block_size * D] views: one contiguous run per (block, head).
    k_runs = k_cache.view(-1, v_cache.shape[2] * d)
    v_runs = v_cache.view(-1, v_cache.shape[2] * d)
    out = q.new_empty(t, num_heads, d)
    if meta.decode_seq_idx:
        if meta.decode_row_range is not None:
            lo, hi = meta.decode_row_range
            out[lo:hi] = decode_attention_torch(q[lo:hi], k_cache, v_cache, meta, scale,
                                                softcap, sinks, scales)
        else:
            assert meta.decode_rows is not None
            q_dec = q.index_select(0, meta.decode_rows)
            out.index_copy_(0, meta.decode_rows, decode_attention_torch(
                q_dec, k_cache, v_cache, meta, scale, softcap, sinks, scales))
    for span in meta.prefills:
        out[span.start:span.end] = _prefill_attention(q, k, v, k_runs, v_runs, span, scale,
                                                      softcap, sinks, caches)
    return out.view(t, num_heads * d)
