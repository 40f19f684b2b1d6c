"""GGUF block formats forerun computes with, and their matmul in plain torch.

A weight row of ``k`` values is ``k / 32`` blocks, as stored in the file:

- Q8_0 (34 bytes): fp16 ``d``, 32 int8 ``q``; ``w = d * q``.
- Q4_0 (18 bytes): fp16 ``d``, 16 bytes of nibbles; ``w = d * (nibble - 8)``.
- Q4_1 (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles; ``w = d * nibble + m``.
- Q5_0 (22 bytes): fp16 ``d``, 4 bytes ``qh``, 16 bytes of nibbles; ``w = d * (q5 - 16)``,
  ``q5`` a nibble with bit ``j`` of ``qh`` (little-endian) as its fifth bit for value ``j``.
- Q5_1 (24 bytes): fp16 ``d``, fp16 ``m``, ``qh``, 16 bytes of nibbles; ``w = d * q5 + m``.
- IQ4_NL (18 bytes): fp16 ``d``, 16 bytes of nibbles, each indexing 16 non-linear levels
  (:data:`IQ4NL_LEVELS`, -127..113); ``w = d * level[nibble]``.
- MXFP4 (17 bytes; gpt-oss's experts): one E8M0 exponent byte ``e``, 16 bytes of nibbles,
  each an FP4 E2M1 value (bit 3 the sign, then 0, .5, 1, 1.5, 2, 3, 4, 6). As ggml does, the
  values are held doubled, as the integers :data:`MXFP4_LEVELS`, with the scale halved:
  ``w = 2^(e - 128) * level[nibble]`` (``d = 2^(e - 128)``, exact in float32, a subnormal
  for ``e < 2``).

Value ``j < 16`` of a 4-bit block is the low nibble of byte ``j``, value ``16 + j`` its high
nibble. Every type is written here as ``w = d * u + c`` per block (``u`` a small integer per
value, ``d`` and ``c`` per block), which is how the C kernel (``csrc/quant_matmul.c``) treats
them too (MXFP4's and IQ4_NL's ``u`` is the signed level here, ``c = 0``; the C kernel's
VNNI bodies read it as ``level + 12`` / ``level + 127`` with ``c = -12 d`` / ``-127 d``,
unsigned for their byte dot products). Q5_0, Q5_1 and IQ4_NL are the 32-value types
llama.cpp's quantizer falls back to in a K-quant file for rows that are not a multiple of
256 values.

In memory the blocks are regrouped by 16 rows (:func:`repack_tiles`; same bytes, same
bits): a tile is one block column of 16 consecutive rows, the 16 ``d`` (and ``m``) first,
then the quants as lines of 64 bytes, line ``j`` holding bytes ``4j..4j+3`` of each row's
quants, so that the C kernel feeds 16 rows from one load (see ``csrc/quant_matmul.c``);
MXFP4's header is the 16 exponent bytes; a Q5 type's ``qh`` makes the first line.
Q4_K's and Q5_K's 256-value super-blocks (:mod:`forerun.model.quant.kquant_blocks`) are held
in the same kind of tile: the 16 ``d``, the 16 ``dmin``, the 12 scale bytes as 12 lines of
16, then (Q5_K's ``qh`` and) the quants in lines of 64 bytes (:data:`TILED_TYPES`); Q6_K's:
the 16 ``d``, its 16 scale bytes as 16 lines of 16, then ``ql`` and ``qh`` in lines of 64;
IQ4_XS's: the 16 ``d``, the 16 ``scales_h``, its 4 ``scales_l`` bytes as 4 lines of 16, then
the quants in lines of 64 (each 32 values of a super-block then read as an IQ4_NL block);
Q3_K's: the 16 ``d``, its 12 scale bytes as 12 lines of 16, then ``hmask`` and ``qs`` in lines
of 64.

Activations are quantized per row and block of 32 to int8 with the scale
``s = max|x| / 127`` (rounded to nearest even), as llama.cpp does for its q8 activations. We
chose that over keeping activations in float because it turns each block's dot product into
an integer sum of 32 byte products, which the CPU's int8 dot-product instructions (VNNI) do
four at a time for 16 rows at once, with no per-value conversion of the weights to float, so
a token's cost stays the bytes of the weights; the added error is that of
an 8-bit rounding of each activation block (measured on SmolLM2: tests/test_quant_e2e.py).
:func:`gguf_matmul_torch` computes exactly that function with torch operations: it is the
fallback where the C kernels are unavailable, and the reference they are tested against.
"""

from __future__ import annotations

import torch

QK = 32
# ggml's type ids (gguf.GGMLQuantizationType values)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 = 2, 3, 6, 7, 8, 20, 39
BLOCK_BYTES: dict[int, int] = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18,
                               MXFP4: 17}
TYPE_NAMES: dict[int, str] = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
                              Q8_0: "Q8_0", IQ4_NL: "IQ4_NL", MXFP4: "MXFP4"}
# MXFP4's 16 FP4 E2M1 values, doubled (ggml's kvalues_mxfp4): nibble 8 is -0.
MXFP4_LEVELS: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# IQ4_NL's 16 levels (ggml's kvalues_iq4nl).
IQ4NL_LEVELS: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53,
                                 69, 89, 113)


GROUP = 16  # rows per tile
# The K-quants' 256-value super-blocks (formats: :mod:`forerun.model.quant.kquant_blocks`).
QK_K = 256
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 10, 11, 12, 13, 14, 23
KBLOCK_BYTES: dict[int, int] = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210,
                                IQ4_XS: 136}
KTYPE_NAMES: dict[int, str] = {Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K",
                               Q6_K: "Q6_K", IQ4_XS: "IQ4_XS"}
# Every type forerun runs natively, all held in tiles: (bytes, values) of their blocks.
TILED_TYPES: dict[int, tuple[int, int]] = {**{t: (b, QK) for t, b in BLOCK_BYTES.items()},
                                           **{t: (b, QK_K) for t, b in KBLOCK_BYTES.items()}}

# Where each byte of a row's block sits in its tile (csrc/quant_matmul.c reads these), as
# segments (first byte, end, how, tile offset) in the file's byte order: "half" an fp16 per
# row (the 16 rows' values one after another), "col" byte c of every row (lines of 16:
# off + 16 c + r), "line" bytes 4l..4l+3 of each row in lines of 64 (off + 64 l + 4 r).
_HEAD = [(0, 2, "half", 0)]  # d
_DM = [(0, 2, "half", 0), (2, 4, "half", 32)]  # d, then dmin or m
_TILE_SEGMENTS: dict[int, list[tuple[int, int, str, int]]] = {
    Q8_0: [*_HEAD, (2, 34, "line", 32)],
    Q4_0: [*_HEAD, (2, 18, "line", 32)],
    IQ4_NL: [*_HEAD, (2, 18, "line", 32)],
    Q5_0: [*_HEAD, (2, 22, "line", 32)],  # qh is the first line
    Q4_1: [*_DM, (4, 20, "line", 64)],
    Q5_1: [*_DM, (4, 24, "line", 64)],
    MXFP4: [(0, 1, "col", 0), (1, 17, "line", 16)],  # one exponent byte per row
    Q4_K: [*_DM, (4, 16, "col", 64), (16, 144, "line", 256)],
    Q5_K: [*_DM, (4, 16, "col", 64), (16, 176, "line", 256)],  # qh, then the nibbles
    IQ4_XS: [*_DM, (4, 8, "col", 64), (8, 136, "line", 128)],  # d, scales_h, scales_l, qs
    Q6_K: [(0, 128, "line", 288), (128, 192, "line", 2336), (192, 208, "col", 32),
           (208, 210, "half", 0)],  # ql, qh, scales, d
    Q3_K: [(0, 32, "line", 224), (32, 96, "line", 736), (96, 108, "col", 32),
           (108, 110, "half", 0)],  # hmask, qs, scales, d
    Q2_K: [(0, 16, "col", 64), (16, 80, "line", 320), (80, 82, "half", 0),
           (82, 84, "half", 32)],  # scales, qs, d, dmin
}


def _tile_map(qtype: int) -> torch.Tensor:
    """``[16, block_bytes]``: where byte ``t`` of row ``r``'s block sits in a tile."""
    out = torch.empty(GROUP, TILED_TYPES[qtype][0], dtype=torch.int64)
    for start, end, how, off in _TILE_SEGMENTS[qtype]:
        q = torch.arange(end - start)
        for r in range(GROUP):
            out[r, start:end] = (off + 2 * r + q if how == "half"
                                 else off + 16 * q + r if how == "col"
                                 else off + 64 * (q // 4) + 4 * r + q % 4)
    return out


_TILE_MAPS: dict[int, torch.Tensor] = {t: _tile_map(t) for t in TILED_TYPES}


def repack_tiles(qtype: int, raw: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``raw`` ``[n, row_bytes]`` (the file's blocks) as tiles of 16 rows, uint8
    ``[ceil(n/16) * blocks per row * 16 * block_bytes]``; a last group is padded with zero
    blocks."""
    bs, vals = TILED_TYPES[qtype]
    n, nb = raw.shape[0], k // vals
    groups = -(-n // GROUP)
    padded = raw.new_zeros(groups * GROUP, nb * bs)
    padded[:n] = raw
    blocks = padded.view(groups, GROUP, nb, bs).permute(0, 2, 1, 3).reshape(groups, nb, -1)
    tiles = raw.new_empty(groups, nb, GROUP * bs)
    tiles[..., _TILE_MAPS[qtype].to(raw.device).reshape(-1)] = blocks
    return tiles.reshape(-1)


def tile_rows(qtype: int, tiles: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The file's blocks of the rows ``rows`` (int64 ``[T]``) of ``tiles``, ``[T, row_bytes]``."""
    bs, vals = TILED_TYPES[qtype]
    nb = k // vals
    t = tiles.view(-1, nb, GROUP * bs)
    picked = t.index_select(0, rows // GROUP)  # [T, nb, 16 * bs]
    idx = _TILE_MAPS[qtype].to(tiles.device)[rows % GROUP]  # [T, bs]
    out = torch.gather(picked, 2, idx.unsqueeze(1).expand(-1, nb, -1))
    return out.reshape(rows.shape[0], nb * bs)


def tiles_to_blocks(qtype: int, tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """All ``n`` rows of ``tiles`` back in the file's layout, ``[n, row_bytes]``."""
    bs, vals = TILED_TYPES[qtype]
    nb = k // vals
    t = tiles.view(-1, nb, GROUP * bs)[..., _TILE_MAPS[qtype].to(tiles.device).reshape(-1)]
    blocks = t.view(-1, nb, GROUP, bs).permute(0, 2, 1, 3).reshape(-1, nb * bs)
    return blocks[:n]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` values in block type ``qtype``."""
    if k % QK:
        raise ValueError(f"a quantized row needs a multiple of {QK} values, got {k}")
    return BLOCK_BYTES[qtype] * (k // QK)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    # b [..., 2] uint8 (little-endian halves) -> float32 [...]
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """float32 ``2^(e - 128)`` of E8M0 exponent bytes ``e`` (uint8): ``2^(e - 127)`` halved,
    the scale of MXFP4's doubled levels, exactly (subnormal for ``e < 2``, as ggml's
    ``ggml_e8m0_to_fp32_half``)."""
    e = e.to(torch.int32)
    # e >= 2: the float whose exponent field is e - 1; else the subnormal 2^-128 << e.
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _levels(qtype: int, device: torch.device) -> torch.Tensor:
    levels = MXFP4_LEVELS if qtype == MXFP4 else IQ4NL_LEVELS
    return torch.tensor(levels, dtype=torch.float32, device=device)


def unpack_blocks(qtype: int, raw: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u, d, c)`` of rows ``raw`` ``[n, row_bytes]`` uint8: ``u`` float32 ``[n, k/32, 32]``
    (integers), ``d`` and ``c`` float32 ``[n, k/32]``, with ``w = d * u + c``."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // QK, BLOCK_BYTES[qtype])
    if qtype in (MXFP4, IQ4_NL):
        off = 1 if qtype == MXFP4 else 2
        qs = blocks[..., off:].to(torch.int64)
        u = _levels(qtype, raw.device)[torch.cat([qs & 0x0F, qs >> 4], dim=-1)]
        d = e8m0_half(blocks[..., 0]) if qtype == MXFP4 else _fp16(blocks[..., 0:2])
        return u, d, torch.zeros_like(d)
    d = _fp16(blocks[..., 0:2])
    if qtype == Q8_0:
        u = blocks[..., 2:].contiguous().view(torch.int8).float()
        return u, d, torch.zeros_like(d)
    with_m = qtype in (Q4_1, Q5_1)
    off = 4 if with_m else 2
    if qtype in (Q5_0, Q5_1):
        qh = blocks[..., off:off + 4].to(torch.int64)
        bits = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        fifth = (bits.unsqueeze(-1) >> torch.arange(32, device=raw.device)) & 1
        off += 4
    qs = blocks[..., off:]
    u = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    if qtype in (Q5_0, Q5_1):
        u = u.to(torch.int64) | fifth << 4
    u = u.float()
    c = (_fp16(blocks[..., 2:4]) if with_m
         else (-16.0 if qtype == Q5_0 else -8.0) * d)
    return u, d, c


def dequantize_rows(qtype: int, raw: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``[n, k]`` values of rows ``raw`` (the file's own values, exactly)."""
    u, d, c = unpack_blocks(qtype, raw, k)
    return (u * d.unsqueeze(-1) + c.unsqueeze(-1)).reshape(raw.shape[0], k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 ``x`` ``[m, k]`` -> ``(q, s, s * sum(q))``: ``q`` float32 integers in
    [-127, 127] ``[m, k/32, 32]``, ``s`` and the scaled sums ``[m, k/32]``."""
    m, k = x.shape
    xb = x.reshape(m, k // QK, QK)
    s = xb.abs().amax(dim=-1) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(xb * inv.unsqueeze(-1))
    return q, s, s * q.sum(dim=-1)


def gguf_matmul_torch(x: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` the rows of ``parts`` (``(type, raw rows)``, stacked),
    activations quantized per 32-block as the C kernel does; ``x`` ``[..., k]``."""
    k = x.shape[-1]
    xf = x.reshape(-1, k).float()
    q, s, ss = quantize_activations(xf)
    outs = []
    for qtype, raw in parts:
        u, d, c = unpack_blocks(qtype, raw, k)
        y = ss @ c.t()
        for b in range(k // QK):
            # Integer sums of at most 32 * 255 * 127: exact in float32.
            y += (q[:, b] @ u[:, b].t()) * (s[:, b, None] * d[None, :, b])
        outs.append(y)
    out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
