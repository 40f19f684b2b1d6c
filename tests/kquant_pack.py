"""A test-only packer for GGUF K-quants (Q2_K ... Q6_K, IQ4_XS) and IQ4_NL: float rows -> the
file's bytes.

The ``gguf`` package reads these types but cannot write them, so the tests quantize with
this plain round-to-nearest packer (simpler than llama.cpp's searched scales, so a little
less accurate) and check every kernel against ``gguf``'s own dequantization of the bytes it
wrote, never against this file's idea of the format. :func:`random_kblocks` makes blocks of
random bytes instead, so that every bit pattern (large and negative scales) is exercised.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GT

QK_K = 256
BLOCK_BYTES = {GT.Q2_K: 84, GT.Q3_K: 110, GT.Q4_K: 144, GT.Q5_K: 176, GT.Q6_K: 210,
               GT.IQ4_XS: 136}
# Byte offsets of each type's fp16 super-block scales (d, and dmin where there is one).
_HALF_OFFSETS = {GT.Q2_K: (80, 82), GT.Q3_K: (108,), GT.Q4_K: (0, 2), GT.Q5_K: (0, 2),
                 GT.Q6_K: (208,), GT.IQ4_XS: (0,)}
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                        113], dtype=np.float32)


def _f16(v: np.ndarray) -> np.ndarray:
    """[nb] float -> [nb, 2] uint8 (the fp16's bytes)."""
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _asym(x: np.ndarray, sub: int, qmax: int, smax: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scale-and-min quantization of ``x`` [nb, 256] per ``sub`` values: ``(q, sc, m, d,
    dmin)`` with ``x ~ d * sc * q - dmin * m``, ``q`` in 0..qmax, ``sc, m`` in 0..smax."""
    nb = x.shape[0]
    xs = x.reshape(nb, -1, sub)
    lo = np.minimum(xs.min(axis=-1), 0.0)  # the offset is -dmin * m <= 0
    scale = (xs.max(axis=-1) - lo) / qmax
    d = scale.max(axis=-1) / smax
    dmin = (-lo).max(axis=-1) / smax
    # What the file will hold: fp16 d/dmin, integer scales and mins.
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_ratio(scale, d[:, None])), 0, smax)
    m = np.clip(np.round(_ratio(-lo, dmin[:, None])), 0, smax)
    step = d[:, None, None] * sc[..., None]
    q = np.clip(np.round(_ratio(xs + (dmin[:, None] * m)[..., None], step)), 0, qmax)
    return (q.reshape(nb, QK_K).astype(np.uint8), sc.astype(np.uint8), m.astype(np.uint8),
            d, dmin)


def _sym(x: np.ndarray, qmin: int, qmax: int, smax: int
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric quantization of ``x`` [nb, 256] per 16: ``(q, sc, d)``, ``x ~ d * sc * q``,
    ``q`` in qmin..qmax, ``sc`` in 0..smax."""
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    scale = np.abs(xs).max(axis=-1) / -qmin
    d = (scale.max(axis=-1) / smax).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_ratio(scale, d[:, None])), 0, smax)
    step = d[:, None, None] * sc[..., None]
    q = np.clip(np.round(_ratio(xs, step)), qmin, qmax)
    return q.reshape(nb, QK_K).astype(np.int32), sc.astype(np.int32), d


def _two_bit_planes(u: np.ndarray) -> np.ndarray:
    """[nb, 256] values 0..3 -> [nb, 64] bytes: value 128h + 32g + i in bits 2g of byte
    32h + i."""
    p = u.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (p[:, :, 0] | (p[:, :, 1] << 2) | (p[:, :, 2] << 4) | (p[:, :, 3] << 6)).reshape(
        -1, 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """[nb, 256] bits -> [nb, 32] bytes: value 32t + i in bit t of byte i."""
    p = bits.reshape(-1, 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(p << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def _pack_blocks(qtype: GT, x: np.ndarray) -> np.ndarray:
    """[nb, 256] float32 -> [nb, block_bytes] uint8."""
    nb = x.shape[0]
    if qtype in (GT.Q4_K, GT.Q5_K):
        q, sc, m, d, dmin = _asym(x, 32, 15 if qtype == GT.Q4_K else 31, 63)
        scales = np.concatenate([
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1).astype(np.uint8)
        low = (q & 15).reshape(nb, 4, 2, 32)
        qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
        parts = [_f16(d), _f16(dmin), scales]
        if qtype == GT.Q5_K:
            parts.append(_bit_planes(q >> 4))
        return np.concatenate([*parts, qs], axis=1)
    if qtype == GT.Q6_K:
        q, sc, d = _sym(x, -32, 31, 127)
        u = (q + 32).astype(np.uint8).reshape(nb, 2, 128)
        ql = ((u[..., :64] & 15) | ((u[..., 64:] & 15) << 4)).reshape(nb, 128)
        hi = (u >> 4).reshape(nb, 2, 4, 32)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
        return np.concatenate([ql, qh.reshape(nb, 64), sc.astype(np.int8).view(np.uint8),
                               _f16(d)], axis=1)
    if qtype == GT.Q3_K:
        q, sc, d = _sym(x, -4, 3, 31)
        u = q + 4
        s6 = (sc + 32).astype(np.uint8)  # stored with an offset of 32
        scales = np.concatenate([
            (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4),
            np.bitwise_or.reduce(((s6 >> 4) & 3).reshape(nb, 4, 4)
                                 << (2 * np.arange(4, dtype=np.uint8))[None, :, None],
                                 axis=1)], axis=1)
        return np.concatenate([_bit_planes(u >> 2), _two_bit_planes(u & 3), scales, _f16(d)],
                              axis=1)
    if qtype == GT.IQ4_XS:
        xs = x.reshape(nb, 8, 32)
        # Per 32: the value of largest magnitude lands on the level -127 (the scale may be
        # negative), the rest on their nearest level.
        peak = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[..., None], -1)[..., 0]
        scale = peak / -127.0
        d = (np.abs(scale).max(axis=-1) / 31).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(_ratio(scale, d[:, None])), -32, 31)
        step = (d[:, None] * sc)[..., None]
        idx = np.abs(_IQ4_LEVELS * step[..., None] - xs[..., None]).argmin(axis=-1)
        idx = idx.astype(np.uint8)  # [nb, 8, 32]
        qs = (idx[..., :16] | (idx[..., 16:] << 4)).reshape(nb, 128)
        u = (sc + 32).astype(np.uint16)
        high = np.bitwise_or.reduce(((u >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16)),
                                    axis=1).astype(np.uint16)
        low = (u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)
        return np.concatenate([_f16(d), high.reshape(-1, 1).view(np.uint8),
                               low.astype(np.uint8), qs], axis=1)
    if qtype == GT.Q2_K:
        q, sc, m, d, dmin = _asym(x, 16, 3, 15)
        return np.concatenate([sc | (m << 4), _two_bit_planes(q), _f16(d), _f16(dmin)],
                              axis=1)
    raise ValueError(f"not a K-quant: {qtype!r}")


def pack_kquant(w: np.ndarray, qtype: GT) -> np.ndarray:
    """float ``w`` ``[n, k]`` (``k`` a multiple of 256) -> uint8 ``[n, k / 256 *
    block_bytes]``, the rows as a GGUF file stores them."""
    n, k = w.shape
    blocks = _pack_blocks(qtype, np.asarray(w, dtype=np.float32).reshape(-1, QK_K))
    assert blocks.shape[1] == BLOCK_BYTES[qtype]
    return np.ascontiguousarray(blocks.reshape(n, k // QK_K * BLOCK_BYTES[qtype]))


def random_kblocks(qtype: GT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of random bytes (every bit pattern of quants and scales) with small positive fp16
    super-block scales, so the values stay finite and of order one."""
    nb = k // QK_K
    raw = rng.integers(0, 256, size=(n * nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for off in _HALF_OFFSETS[qtype]:
        raw[:, off:off + 2] = _f16(rng.uniform(1e-3, 1e-2, size=n * nb))
    return raw.reshape(n, nb * BLOCK_BYTES[qtype])


def pack_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float ``w`` ``[n, k]`` (``k`` a multiple of 32) -> IQ4_NL rows ``[n, k / 32 * 18]``:
    per 32 values the one of largest magnitude on the level -127 (``d`` may be negative),
    the rest on their nearest level."""
    n, k = w.shape
    xs = np.asarray(w, dtype=np.float32).reshape(-1, 32)
    peak = np.take_along_axis(xs, np.abs(xs).argmax(axis=-1)[:, None], -1)[:, 0]
    d = (peak / -127.0).astype(np.float16).astype(np.float32)
    idx = np.abs(_IQ4_LEVELS * d[:, None, None] - xs[..., None]).argmin(axis=-1)
    idx = idx.astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.ascontiguousarray(np.concatenate([_f16(d), qs], axis=1).reshape(n, k // 32 * 18))


def pack_blocks(w: np.ndarray, qtype: GT) -> np.ndarray:
    """``w`` in ``qtype``: this module's packers for the types ``gguf`` cannot write, else
    ``gguf.quants.quantize``."""
    from gguf.quants import quantize

    if qtype in BLOCK_BYTES:
        return pack_kquant(w, qtype)
    if qtype == GT.IQ4_NL:
        return pack_iq4_nl(w)
    return quantize(np.asarray(w, dtype=np.float32), qtype)
