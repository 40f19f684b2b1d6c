"""GGUF K-quant block formats (Q2_K ... Q6_K, IQ4_XS) forerun computes with, and their matmul
in torch.

A weight row of ``k`` values is ``k / 256`` super-blocks, held regrouped in tiles of 16 rows
(the same bytes: :mod:`.gguf_blocks`, read by ``csrc/quant_matmul.c``). ggml's layouts, byte
offsets within one super-block (``d``/``dmin`` fp16):

- Q2_K (84 bytes): 16 bytes of scales (low nibble scale, high nibble min, per 16 values),
  64 bytes of 2-bit quants, ``d``, ``dmin``; ``w = d * sc * q - dmin * m``, ``q`` in 0..3.
- Q3_K (110 bytes): 32 bytes of high bits (``hmask``), 64 bytes of low 2 bits, 12 bytes of
  6-bit scales (offset by 32) per 16 values, ``d``; ``w = d * sc * q``, ``q`` in -4..3.
- Q4_K (144 bytes): ``d``, ``dmin``, 12 bytes of 6-bit scales and mins for 8 sub-blocks of
  32, 128 bytes of nibbles; ``w = d * sc * q - dmin * m``, ``q`` in 0..15.
- Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits before the nibbles; ``q`` in 0..31.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high 2 bits, 16 int8 scales per
  16 values, ``d``; ``w = d * sc * q``, ``q`` in -32..31.
- IQ4_XS (136 bytes): ``d``, 2 + 4 bytes of 6-bit scales (offset by 32) per 32 values, 128
  bytes of nibbles, each an index into 16 fixed levels (:data:`IQ4NL_LEVELS`);
  ``w = d * sc * level``.

Which bits of which byte hold value ``v`` of a super-block follows ``gguf.quants`` (the
oracle the tests read; spelled out in :func:`unpack_kblocks` and in the C file).

Activations are quantized as for the 32-value types (:mod:`.gguf_blocks`): per row and
block of 32 to int8 with the scale ``s = max|x| / 127`` (rounded to nearest even). llama.cpp
quantizes them per 256 for these types (Q8_K: one scale per super-block, so the kernel turns
a super-block's integer sum into float once instead of 8 times), and that is what this began
with; but one outlier channel then coarsens the other 255 values of its block, and on SmolLM2
(widened to whole super-blocks, tests/test_quant_e2e.py) in Q6_K the teacher-forced NLL moved
1.7% from the exact engine's per 256, 0.5% per 32. A super-block then costs 8 FMAs more per
row in the kernels, which read their integer sums per 32 values and the sub-block mins from
the activations' sums. :func:`kquant_matmul_torch` computes
the same function with torch operations: the fallback where the C kernel is unavailable, and
the reference it is tested against.
"""

from __future__ import annotations

import torch

from forerun.model.quant.gguf_blocks import (
    IQ4_XS,
    IQ4NL_LEVELS,
    KBLOCK_BYTES,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    QK_K,
    quantize_activations,
)


def krow_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` values in K-quant type ``qtype``."""
    if k % QK_K:
        raise ValueError(f"a K-quant row needs a multiple of {QK_K} values, got {k}")
    return KBLOCK_BYTES[qtype] * (k // QK_K)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    # b [..., 2] uint8 (little-endian halves) -> float32 [..., 1]
    return b.contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """``(b >> shift) & mask`` for each shift, stacked on a new axis before the last:
    ``b`` ``[..., L]`` -> ``[..., len(shifts), L]`` int32."""
    b = b.to(torch.int32)
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes
    ``[..., 12]``: bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7,
    bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble)
    and of mins 4-7 (high nibble)."""
    s = sc.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def unpack_kblocks(qtype: int, raw: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, dl, ml)`` of rows ``raw`` ``[n, row_bytes]`` uint8, with ``w = dl * q - ml``
    per 16 values: ``q`` float32 integers ``[n, k/256, 16, 16]``, ``dl`` (``d`` times the
    sub-block scale) and ``ml`` (``dmin`` times the sub-block min, 0 where the type has none)
    float32 ``[n, k/256, 16, 1]``; the products are the ones ``gguf.quants`` forms, so the
    values come out bit for bit as it dequantizes them."""
    n, nb, dev = raw.shape[0], k // QK_K, raw.device  # any device: the fallback off CPU
    b = raw.reshape(n, nb, KBLOCK_BYTES[qtype])
    if qtype in (Q4_K, Q5_K):
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        # Value 32 * s + i: nibble (s % 2) of byte 32 * (s // 2) + i of the quants.
        qs = b[..., 48:] if qtype == Q5_K else b[..., 16:]
        q = _bits(qs.reshape(n, nb, 4, 32), [0, 4], 0x0F).reshape(n, nb, 8, 32)
        if qtype == Q5_K:  # ...plus bit s of byte i of qh, times 16
            q = q | (_bits(b[..., 16:48], list(range(8)), 1) << 4)
        dl = (d * sc.float()).repeat_interleave(2, dim=-1)  # per 32 -> per 16
        ml = (dmin * mn.float()).repeat_interleave(2, dim=-1)
        return q.reshape(n, nb, 16, 16).float(), dl.unsqueeze(-1), ml.unsqueeze(-1)
    if qtype == Q6_K:
        d = _fp16(b[..., 208:210])
        sc = b[..., 192:208].contiguous().view(torch.int8).float()
        # Half h (128 values): value 64 * p + i, low nibble p of byte 64 h + i (i < 64);
        # its top 2 bits: bits 2 g..2 g+1 of byte 32 h + (v % 32), g = v // 32.
        ql = _bits(b[..., 0:128].reshape(n, nb, 2, 64), [0, 4], 0x0F).reshape(n, nb, 2, 128)
        qh = _bits(b[..., 128:192].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 2,
                                                                                 128)
        q = ((ql | (qh << 4)) - 32).reshape(n, nb, 16, 16)
        return q.float(), (d * sc).unsqueeze(-1), torch.zeros(n, nb, 16, 1, device=dev)
    if qtype == Q3_K:
        d = _fp16(b[..., 108:110])
        s = b[..., 96:108].to(torch.int32)
        # Scale 8 p + j: low 4 bits are nibble p of byte j; scale 4 t + j: top 2 bits are
        # bits 2 t..2 t+1 of byte 8 + j.
        low = torch.stack([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], dim=-2).reshape(n, nb, 16)
        high = _bits(s[..., 8:12], [0, 2, 4, 6], 3).reshape(n, nb, 16)
        sc = ((low | (high << 4)) - 32).float()
        # Value 128 h + 32 g + i: bits 2 g..2 g+1 of byte 32 h + i of qs; minus 4 where bit
        # v // 32 of hmask byte v % 32 is clear.
        ql = _bits(b[..., 32:96].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 256)
        hb = _bits(b[..., 0:32], list(range(8)), 1).reshape(n, nb, 256)
        q = (ql - 4 * (1 - hb)).reshape(n, nb, 16, 16)
        return q.float(), (d * sc).unsqueeze(-1), torch.zeros(n, nb, 16, 1, device=dev)
    if qtype == IQ4_XS:
        d = _fp16(b[..., 0:2])
        # Scale s: nibble s % 2 of byte 4 + s // 2, plus bits 2 s..2 s+1 of the uint16 at
        # bytes 2-3 times 16, minus 32.
        sh = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)
        sl = b[..., 4:8].to(torch.int32)
        low = torch.stack([sl & 0x0F, sl >> 4], dim=-1).reshape(n, nb, 8)
        high = (sh.unsqueeze(-1) >> (2 * torch.arange(8, device=dev))) & 3
        sc = ((low | (high << 4)) - 32).float()
        # Value 32 s + 16 p + i: level of nibble p of byte 8 + 16 s + i.
        idx = _bits(b[..., 8:].reshape(n, nb, 8, 16), [0, 4], 0x0F).reshape(n, nb, 256)
        q = torch.tensor(IQ4NL_LEVELS, dtype=torch.float32, device=dev)[idx.long()]
        return (q.reshape(n, nb, 16, 16), (d * sc).repeat_interleave(2, dim=-1).unsqueeze(-1),
                torch.zeros(n, nb, 16, 1, device=dev))
    if qtype == Q2_K:
        d, dmin = _fp16(b[..., 80:82]), _fp16(b[..., 82:84])
        s = b[..., 0:16].to(torch.int32)
        q = _bits(b[..., 16:80].reshape(n, nb, 2, 32), [0, 2, 4, 6], 3).reshape(n, nb, 16, 16)
        return (q.float(), (d * (s & 0x0F).float()).unsqueeze(-1),
                (dmin * (s >> 4).float()).unsqueeze(-1))
    raise ValueError(f"not a K-quant type: {qtype}")


def dequantize_krows(qtype: int, raw: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[n, k]`` values of rows ``raw`` (the file's own values, exactly)."""
    q, dl, ml = unpack_kblocks(qtype, raw, k)
    return (dl * q - ml).reshape(raw.shape[0], k)


def kquant_matmul_torch(x: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
                        bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the rows of ``parts`` (``(type, raw rows)``, stacked),
    activations quantized per 32 as the C kernel does; ``x`` ``[..., k]``. The product of
    the quantized activations with the exact weight values is what the kernel's integer sums
    compute; only the order of the float rounding differs."""
    k = x.shape[-1]
    q, s, _ = quantize_activations(x.reshape(-1, k).float())
    xq = (q * s.unsqueeze(-1)).reshape(-1, k)
    w = torch.cat([dequantize_krows(qtype, raw, k) for qtype, raw in parts])
    out = xq @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
