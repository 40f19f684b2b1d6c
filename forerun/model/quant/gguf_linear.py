"""``quantization="gguf"``: linear layers (and a tied output head) that compute with a GGUF
file's own Q8_0 / Q4_0 / Q4_1 blocks.

The blocks are copied out of the file once, as they are, and never dequantized as a whole:
the C kernel (``csrc/quant_matmul.c``) reads them for every matmul, with activations
quantized per 32-block to int8 (why: :mod:`forerun.model.quant.gguf_blocks`). The
single-stream path runs the same kernel inside its one-call decoder stack
(``forerun/model/small_batch.py``), so a decode step reads each weight in its 4.5-8.5 bits.

Embedding and output head: SmolLM2-style models tie them, and the head (vocab x hidden) is a
fifth of the model's weights, read in full for every sampled token. With quantization="gguf"
the embedding stays in its blocks (a lookup dequantizes just the rows it needs) and the head
is a :class:`GGUFLinear` over those same blocks, so the shared matrix is held once and read at
its quantized size.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from forerun.model import cpu_kernels
from forerun.model.quant.gguf_blocks import (
    BLOCK_BYTES,
    QK,
    TYPE_NAMES,
    dequantize_rows,
    gguf_matmul_torch,
    repack_tiles,
    row_bytes,
    tile_rows,
    tiles_to_blocks,
)

logger = logging.getLogger(__name__)

SUPPORTED_TYPES: frozenset[int] = frozenset(BLOCK_BYTES)


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as GGUF blocks.

    ``parts`` are ``(ggml type id, uint8 rows [rows_i, row_bytes_i])`` stacked along the
    output dimension: a fused projection (q/k/v, gate/up) whose checkpoint tensors differ in
    type keeps each as stored. ``bias`` stays a float parameter (loaded like any other).
    """

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 bias: nn.Parameter | None = None) -> None:
        super().__init__()
        if not 1 <= len(parts) <= cpu_kernels.QUANT_MAX_PARTS:
            raise ValueError(f"a GGUF linear takes 1 to {cpu_kernels.QUANT_MAX_PARTS} parts")
        for qtype, raw in parts:
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"unsupported GGUF block type {qtype}")
            if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(
                    qtype, in_features) or not raw.is_contiguous():
                raise ValueError(f"{TYPE_NAMES[qtype]} rows of {in_features} values must be "
                                 f"contiguous uint8 [rows, {row_bytes(qtype, in_features)}]")
        self.in_features = in_features
        self.out_features = sum(raw.shape[0] for _, raw in parts)
        # (type, rows, tiles): the blocks regrouped by 16 rows for the kernel (gguf_blocks).
        # Plain attributes: nn.Module machinery must not cast or move the bytes.
        self.tiles = [(qtype, raw.shape[0], repack_tiles(qtype, raw, in_features))
                      for qtype, raw in parts]
        self.bias = bias
        self.desc = cpu_kernels.QWeightDesc()
        self.desc.nparts = len(parts)
        for i, (qtype, rows, tiles) in enumerate(self.tiles):
            self.desc.type[i] = qtype
            self.desc.rows[i] = rows
            self.desc.data[i] = tiles.data_ptr()

    @property
    def parts(self) -> list[tuple[int, torch.Tensor]]:
        """``(type, rows [n, row_bytes])`` in the file's layout (rebuilt from the tiles)."""
        return [(qtype, tiles_to_blocks(qtype, tiles, rows, self.in_features))
                for qtype, rows, tiles in self.tiles]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if cpu_kernels.supports(x.dtype, x.device) and (bias is None or bias.dtype == x.dtype):
            return cpu_kernels.quant_matmul(x.contiguous(), self.desc, self.out_features, bias)
        return gguf_matmul_torch(x, self.parts, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, in_features]`` weight rows ``ids`` (single-part linears)."""
        assert len(self.tiles) == 1
        qtype, _, tiles = self.tiles[0]
        return dequantize_rows(qtype, tile_rows(qtype, tiles, self.in_features, ids),
                               self.in_features)

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tiles (for :func:`forerun.model.quant.resident_weight_bytes`)."""
        return [tiles for _, _, tiles in self.tiles]

    def relocate(self, tiles: list[torch.Tensor]) -> None:
        """Read the tiles from ``tiles`` from now on: copies of :meth:`resident_tensors`, in
        its order, somewhere else in memory (see forerun.model.huge_pages)."""
        assert [t.shape for t in tiles] == [t.shape for t in self.resident_tensors()]
        self.tiles = [(qtype, rows, new) for (qtype, rows, _), new in
                      zip(self.tiles, tiles, strict=True)]
        for i, new in enumerate(tiles):
            self.desc.data[i] = new.data_ptr()

    def extra_repr(self) -> str:
        types = "+".join(TYPE_NAMES[t] for t, _, _ in self.tiles)
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
        logger.info("quantization=gguf: %d linears are not in Q8_0/Q4_0/Q4_1 and load "
                    "dequantized, e.g. %s", len(kept), kept[0])
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


__all__ = ["QK", "GGUFEmbedding", "GGUFLinear", "SUPPORTED_TYPES", "apply_gguf_blocks"]
