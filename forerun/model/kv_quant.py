"""Quantized KV cache (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2): names, scales, and
the torch path's quantizing write and dequantizing reads.

A quantized layer cache is ``(k, v, k_scale, v_scale)``: K and V in the layout of
:func:`forerun.model.attention.new_kv_cache` with 1-byte elements, and one float32 scale per
(block, kv head) for each, ``[num_blocks, num_kv_heads]``; a stored value ``q`` means
``q * scale``. How a scale is chosen while its block fills is in docs/kv_cache.md
("Quantized KV"); the C write (``kv_cache_write_kvq`` in csrc/paged_attention.c) and
:func:`write_kv_quantized` here follow the same rule, so either path may read what the
other wrote.
"""

from __future__ import annotations

import torch

# kv_cache_dtype values (vLLM's names) -> the cache's storage dtype; None: the model's own.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
# The 1-byte kinds: their code in the C kernels (KV_INT8 ... in csrc/paged_attention.c) and
# the largest magnitude a scale maps a block's |max| to.
_KIND = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``kv_cache_dtype`` ``name`` for a model computing in
    ``model_dtype``; a ValueError naming the flag for an unknown name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of "
                         f"{', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    dtype = KV_CACHE_DTYPES[name]
    return model_dtype if dtype is None else dtype


def is_quantized(dtype: torch.dtype) -> bool:
    """True for the 1-byte cache dtypes that carry per-(block, head) scales."""
    return dtype in _KIND


def kind_code(dtype: torch.dtype) -> int:
    """The C kernels' code for a cache dtype: 0 for the model dtype, else 1-3."""
    return _KIND.get(dtype, 0)


def bytes_per_element(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def scale_bytes_per_block(num_kv_heads: int, dtype: torch.dtype) -> int:
    """Per layer and block, the bytes of K and V scales (0 for an unquantized cache)."""
    return 2 * num_kv_heads * 4 if is_quantized(dtype) else 0


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (already divided by its scale, float32) as ``dtype`` codes viewed as uint8:
    nearest, ties to even, saturating at the format's largest finite value."""
    qmax = _QMAX[dtype]
    if dtype == torch.int8:
        return torch.round(x).clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
    return x.clamp(-qmax, qmax).to(dtype).view(torch.uint8)


def dequantize(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``codes`` of cache dtype ``dtype`` as float32 values (before their scale)."""
    return codes.view(dtype).to(torch.float32)


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                       slot_mapping: torch.Tensor, v_rows: torch.Tensor,
                       k_elems: torch.Tensor) -> None:
    """Store ``k``/``v`` ``[T, KVH, D]`` in a quantized cache (the torch path).

    ``v_rows`` / ``k_elems`` are where each (token, head) row goes in the caches' flat views
    (:func:`forerun.model.attention.write_kv`'s indices). Per touched (block, head): a step
    that writes the block's offset 0 starts its scale afresh, otherwise the scale grows to
    the step's |max| / qmax if that is larger (for fp8 rounded up to a power of two), and
    the block's stored codes are re-quantized to the grown scale (a ratio of 1 leaves every code as it is, so the untouched ones are
    rewritten unchanged rather than tested for on the host)."""
    t, kvh, d = k.shape
    bs = v_cache.shape[2]
    blocks = slot_mapping // bs
    touched, inverse = torch.unique(blocks, return_inverse=True)
    first = torch.full((touched.shape[0],), bs, dtype=slot_mapping.dtype,
                       device=slot_mapping.device)
    first.scatter_reduce_(0, inverse, slot_mapping % bs, "amin")
    runs = (touched.unsqueeze(1) * kvh + torch.arange(kvh, device=touched.device)).reshape(-1)
    for x, cache, scale, rows in ((k, k_cache, k_scale, None), (v, v_cache, v_scale, v_rows)):
        dtype = cache.dtype
        amax = x.detach().abs().amax(dim=-1).float()  # [T, KVH]
        need = torch.zeros(touched.shape[0], kvh, dtype=torch.float32, device=x.device)
        need.scatter_reduce_(0, inverse.unsqueeze(1).expand(t, kvh), amax, "amax")
        need.div_(_QMAX[dtype])
        if dtype != torch.int8:  # fp8: the power of two at or above (rescales are exact)
            mant, exp = torch.frexp(need)
            pow2 = torch.ldexp(torch.ones_like(need), exp)
            need = torch.where((need > 0) & (mant != 0.5), pow2, need)
        flat_scale = scale.view(-1)
        old = flat_scale.index_select(0, runs).view(-1, kvh)
        old = torch.where((first == 0).unsqueeze(1), torch.zeros_like(old), old)
        new = torch.maximum(old, need)
        ratio = torch.where(old > 0, old / torch.where(new > 0, new, 1.0), 1.0).reshape(-1)
        codes = cache.view(torch.uint8).view(-1, bs * d)
        stored = dequantize(codes.index_select(0, runs), dtype).mul_(ratio.unsqueeze(1))
        codes.index_copy_(0, runs, quantize(stored, dtype))
        flat_scale.index_copy_(0, runs, new.reshape(-1))
        inv = torch.where(new > 0, 1.0 / torch.where(new > 0, new, 1.0), 0.0)
        q = quantize(x.float() * inv.index_select(0, inverse).unsqueeze(2), dtype)
        if rows is None:
            cache.view(torch.uint8).view(-1).index_copy_(0, k_elems, q.reshape(-1))
        else:
            cache.view(torch.uint8).view(-1, d).index_copy_(0, rows, q.reshape(-1, d))


def gather_runs(cache: torch.Tensor, scale: torch.Tensor, runs: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """The (block, head) runs ``runs`` of a cache's ``[num_blocks * KVH, block_size * D]``
    view, dequantized to ``dtype`` (only these runs: the context a step reads)."""
    width = cache.shape[2] * cache.shape[3]
    if not is_quantized(cache.dtype):
        return cache.view(-1, width).index_select(0, runs)
    codes = cache.view(torch.uint8).view(-1, width).index_select(0, runs)
    values = dequantize(codes, cache.dtype).mul_(scale.view(-1).index_select(0, runs)[:, None])
    return values.to(dtype)


def read_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor, slot_mapping: torch.Tensor, v_rows: torch.Tensor,
              k_elems: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own rows as the cache now holds them, ``[T, KVH, D]`` each in ``dtype``:
    what a prompt chunk with no earlier context attends to over a quantized cache, so that
    every path sees the same dequantized keys and values."""
    t = slot_mapping.shape[0]
    kvh, bs, d = v_cache.shape[1], v_cache.shape[2], v_cache.shape[3]
    run = (slot_mapping // bs).unsqueeze(1) * kvh + torch.arange(kvh, device=slot_mapping.device)
    vq = v_cache.view(torch.uint8).view(-1, d).index_select(0, v_rows)
    kq = k_cache.view(torch.uint8).view(-1).index_select(0, k_elems)
    v = dequantize(vq, v_cache.dtype).view(t, kvh, d) * v_scale.view(-1)[run].unsqueeze(2)
    k = dequantize(kq, k_cache.dtype).view(t, kvh, d) * k_scale.view(-1)[run].unsqueeze(2)
    return k.to(dtype), v.to(dtype)
