"""``quantization="gguf"``: linear layers (and a tied output head) that compute with a GGUF
file's own blocks: Q8_0 / Q4_0 / Q4_1, Q5_0 / Q5_1 / IQ4_NL (what K-quant files hold where a
row is not whole super-blocks), MXFP4 (gpt-oss's experts), and the K-quants Q2_K / Q3_K /
Q4_K / Q5_K / Q6_K and IQ4_XS.

The blocks are copied out of the file once and never dequantized as a whole: every native
type is regrouped in tiles of 16 rows (the same bytes). The C kernels read them for every
matmul through one entry point (``csrc/gguf_matmul.c``, then ``csrc/quant_matmul.c``), with
activations quantized per 32 (why: :mod:`forerun.model.quant.gguf_blocks`; the K-quants:
:mod:`forerun.model.quant.kquant_blocks`). In tiles a row's dot product needs no horizontal
sum and one load feeds 16 rows, which made Q4_K's matmul 1.2x faster for one token and 2x
for 64 (2048 x 8192 on 2 cores). Where the CPU has AMX, a bfloat16 matmul of many rows (a
prefill, a large batch) of tiles instead dequantizes each pair of 16-row groups to bfloat16
tiles once and runs every row against them (``csrc/quant_amx.c``): 4.4-5.8x the integer
bodies for K-quants at 512 rows on 2 cores, level with a bfloat16 GEMM. A fused projection
whose parts differ in type runs in one call. The single-stream path runs the same
entry point inside its one-call decoder stack (``forerun/model/small_batch.py``), so a
decode step reads each weight in its 2.6-8.5 bits.

Embedding and output head: SmolLM2-style models tie them, and the head (vocab x hidden) is a
fifth of the model's weights, read in full for every sampled token. With quantization="gguf"
the embedding stays in its blocks (a lookup dequantizes just the rows it needs) and the head
is a :class:`GGUFLinear` over those same blocks, so the shared matrix is held once and read at
its quantized size.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from forerun.model import cpu_kernels
from forerun.model.quant.gguf_blocks import (
    BLOCK_BYTES,
    KBLOCK_BYTES,
    KTYPE_NAMES,
    QK,
    QK_K,
    TYPE_NAMES,
    dequantize_rows,
    gguf_matmul_torch,
    repack_tiles,
    row_bytes,
    tile_rows,
    tiles_to_blocks,
)
from forerun.model.quant.kquant_blocks import dequantize_krows, kquant_matmul_torch, krow_bytes

logger = logging.getLogger(__name__)

KQUANT_TYPES: frozenset[int] = frozenset(KBLOCK_BYTES)
SUPPORTED_TYPES: frozenset[int] = frozenset(BLOCK_BYTES) | KQUANT_TYPES
NATIVE_TYPE_NAMES: dict[int, str] = {**TYPE_NAMES, **KTYPE_NAMES}


def _type_row_bytes(qtype: int, k: int) -> int:
    return krow_bytes(qtype, k) if qtype in KQUANT_TYPES else row_bytes(qtype, k)


def block_values(qtype: int) -> int:
    """Values per block of ``qtype``: 256 for the K-quants (and IQ4_XS), else 32."""
    return QK_K if qtype in KQUANT_TYPES else QK


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as GGUF blocks.

    ``parts`` are ``(ggml type id, uint8 rows [rows_i, row_bytes_i])`` stacked along the
    output dimension: a fused projection (q/k/v, gate/up) whose checkpoint tensors differ in
    type keeps each as stored. ``bias`` stays a float parameter (loaded like any other).
    Every part is held regrouped by 16 rows (:func:`repack_tiles`).
    """

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 bias: nn.Parameter | None = None) -> None:
        super().__init__()
        if not 1 <= len(parts) <= cpu_kernels.QUANT_MAX_PARTS:
            raise ValueError(f"a GGUF linear takes 1 to {cpu_kernels.QUANT_MAX_PARTS} parts")
        for qtype, raw in parts:
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"unsupported GGUF block type {qtype}")
            rb = _type_row_bytes(qtype, in_features)
            if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != rb or \
                    not raw.is_contiguous():
                raise ValueError(f"{NATIVE_TYPE_NAMES[qtype]} rows of {in_features} values "
                                 f"must be contiguous uint8 [rows, {rb}]")
        self.in_features = in_features
        self.out_features = sum(raw.shape[0] for _, raw in parts)
        # (type, rows, stored bytes). Plain attributes: nn.Module machinery must not cast or
        # move the bytes.
        self.tiles = [(qtype, raw.shape[0], repack_tiles(qtype, raw, in_features))
                      for qtype, raw in parts]
        self.bias = bias
        # The descriptor csrc/gguf_matmul.c reads (and the one-call decoder stack's table
        # holds): every part's type, rows and tiles.
        self.desc = cpu_kernels.QWeightDesc()
        self.desc.nparts = len(self.tiles)
        for slot, (qtype, rows, stored) in enumerate(self.tiles):
            self.desc.type[slot] = qtype
            self.desc.rows[slot] = rows
            self.desc.data[slot] = stored.data_ptr()

    @property
    def parts(self) -> list[tuple[int, torch.Tensor]]:
        """``(type, rows [n, row_bytes])`` in the file's layout (rebuilt from the tiles)."""
        return [(qtype, tiles_to_blocks(qtype, stored, rows, self.in_features))
                for qtype, rows, stored in self.tiles]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if cpu_kernels.supports(x.dtype, x.device) and (bias is None or bias.dtype == x.dtype):
            return cpu_kernels.gguf_matmul(x.contiguous(), self.desc, self.out_features,
                                           None if bias is None else bias.contiguous())
        return self.forward_torch(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x @ W.T + bias`` from float32 or bfloat16 ``x``: an output head, whose
        logits are not rounded to the model dtype (bfloat16 rows go to the kernel as they
        are, where many of them take the AMX path)."""
        if x.dtype == torch.bfloat16 and cpu_kernels.supports(x.dtype, x.device):
            bias = None if self.bias is None else self.bias.float().contiguous()
            return cpu_kernels.gguf_matmul(x.contiguous(), self.desc, self.out_features, bias,
                                           out_dtype=torch.float32)
        return self(x.float())

    def family_runs(self) -> list[tuple[bool, list[tuple[int, torch.Tensor]]]]:
        """The parts (:attr:`parts`) in runs of one family, ``(K-quant?, parts)`` in row
        order: the torch functions take one family each."""
        return [(kq, list(run)) for kq, run in
                itertools.groupby(self.parts, key=lambda part: part[0] in KQUANT_TYPES)]

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The same function in torch (the fallback, and the kernels' reference)."""
        outs, col = [], 0
        for kq, run in self.family_runs():
            rows = sum(raw.shape[0] for _, raw in run)
            # Each family's columns with their share of the bias, rounded once to x's dtype.
            bias = None if self.bias is None else self.bias[col:col + rows]
            outs.append((kquant_matmul_torch if kq else gguf_matmul_torch)(x, run, bias))
            col += rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, in_features]`` weight rows ``ids`` (single-part linears)."""
        assert len(self.tiles) == 1
        qtype, _, stored = self.tiles[0]
        raw = tile_rows(qtype, stored, self.in_features, ids)
        if qtype in KQUANT_TYPES:
            return dequantize_krows(qtype, raw, self.in_features)
        return dequantize_rows(qtype, raw, self.in_features)

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tiles (for :func:`forerun.model.quant.resident_weight_bytes`)."""
        return [tiles for _, _, tiles in self.tiles]

    def take_rows(self, ids: torch.Tensor, pad: int = 0) -> GGUFLinear:
        """A linear of output rows ``ids`` (ascending) of this one, each part keeping its
        type, then ``pad`` zero rows (zero blocks: every type decodes them to 0); the bias
        taken with its rows. For a tensor-parallel rank's column-parallel share."""
        parts, start = [], 0
        for qtype, raw in self.parts:
            n = raw.shape[0]
            local = ids[(ids >= start) & (ids < start + n)] - start
            if len(local):
                parts.append((qtype, raw[local].contiguous()))
            start += n
        if pad:
            qtype, raw = parts[-1]
            parts[-1] = (qtype, torch.cat([raw, raw.new_zeros(pad, raw.shape[1])]))
        bias = None
        if self.bias is not None:
            b = self.bias.detach()[ids]
            bias = nn.Parameter(torch.cat([b, b.new_zeros(pad)]) if pad else b,
                                requires_grad=False)
        return GGUFLinear(parts, self.in_features, bias)

    def take_columns(self, start: int, end: int) -> GGUFLinear:
        """A linear over input columns ``start:end`` of this one (no bias): a
        tensor-parallel rank's row-parallel share. The cut must fall between blocks."""
        parts = []
        for qtype, raw in self.parts:
            vals = block_values(qtype)
            if start % vals or end % vals:
                raise ValueError(
                    f"the tensor-parallel split cuts a {NATIVE_TYPE_NAMES[qtype]} weight of "
                    f"{self.in_features} input values at {start}:{end}, inside its blocks of "
                    f"{vals} values; choose a tensor_parallel_size that splits it at a "
                    "multiple of that, or load the file dequantized (quantization=None) or "
                    "as int8")
            per = raw.shape[1] // (self.in_features // vals)
            parts.append((qtype, raw[:, start // vals * per:end // vals * per].contiguous()))
        return GGUFLinear(parts, end - start)

    def relocate(self, tiles: list[torch.Tensor]) -> None:
        """Read the tiles from ``tiles`` from now on: copies of :meth:`resident_tensors`, in
        its order, somewhere else in memory (see forerun.model.huge_pages)."""
        assert [t.shape for t in tiles] == [t.shape for t in self.resident_tensors()]
        self.tiles = [(qtype, rows, new) for (qtype, rows, _), new in
                      zip(self.tiles, tiles, strict=True)]
        for slot, new in enumerate(tiles):
            self.desc.data[slot] = new.data_ptr()

    def extra_repr(self) -> str:
        types = "+".join(NATIVE_TYPE_NAMES[t] for t, _, _ in self.tiles)
        return f"in_features={self.in_features}, out_features={self.out_features}, {types}"


class GGUFEmbedding(nn.Module):
    """Token embedding held as GGUF blocks; a lookup dequantizes only the rows asked for.

    The blocks are those of a :class:`GGUFLinear` (for a tied model, the output head's own:
    the matrix is held once)."""

    def __init__(self, table: GGUFLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if len(table.tiles) != 1:
            raise ValueError("an embedding is one GGUF tensor")
        # In a list: a submodule here would make the head's parameters appear twice.
        self._table = [table]
        self.dim, self.dtype = table.in_features, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._table[0].rows(input_ids.reshape(-1)).to(self.dtype)
        return out.reshape(*input_ids.shape, self.dim)

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tiles (for :func:`forerun.model.quant.resident_weight_bytes`)."""
        return self._table[0].resident_tensors()


def _checkpoint_parts(model: nn.Module, path: str) -> list[str]:
    """Checkpoint weight names a linear at module ``path`` is made of, in row order."""
    parent, _, leaf = path.rpartition(".")
    shards = sorted(((off, key) for key, (fused, off, _) in model.packed_shards().items()
                     if fused == leaf), key=lambda t: t[0])
    prefix = f"{parent}." if parent else ""
    if shards:
        return [f"{prefix}{key}.weight" for _, key in shards]
    return [f"{prefix}{leaf}.weight"]


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_gguf_blocks(model: nn.Module, blocks: dict[str, tuple[int, torch.Tensor]],
                      dtype: torch.dtype) -> set[str]:
    """Swap the model's linears (and its embedding, and a tied head) for block-backed ones
    wherever every checkpoint tensor they are made of is in ``blocks`` (``hf_name ->
    (type, rows)``); returns the names consumed, which are then not loaded dequantized."""
    used: set[str] = set()
    kept: list[str] = []
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        names = _checkpoint_parts(model, path)
        if not all(n in blocks for n in names):
            kept.append(path)
            continue
        parts = [blocks[n] for n in names]
        if sum(raw.shape[0] for _, raw in parts) != module.out_features:
            continue
        _set_module(model, path, GGUFLinear(parts, module.in_features, module.bias))
        used.update(names)
    if kept:
        logger.info("quantization=gguf: %d linears have a part in a type not run natively "
                    "and load dequantized, e.g. %s", len(kept), kept[0])
    emb_name = "model.embed_tokens.weight"
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb_name in blocks and isinstance(embed, nn.Embedding):
        table = GGUFLinear([blocks[emb_name]], embed.embedding_dim)
        model.model.embed_tokens = GGUFEmbedding(table, dtype)
        used.add(emb_name)
        if getattr(model, "lm_head", None) is None:  # tied: the head reads the same blocks
            model.quant_head = table
    if isinstance(getattr(model, "lm_head", None), GGUFLinear):
        model.quant_head = model.lm_head
    return used


__all__ = ["block_values", "KQUANT_TYPES", "NATIVE_TYPE_NAMES", "QK", "SUPPORTED_TYPES", "GGUFEmbedding",
           "GGUFLinear", "apply_gguf_blocks"]
