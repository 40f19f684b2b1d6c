"""Entry points the runner uses: resolve a model, read its config, build it, load its tokenizer."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from gguf import GGMLQuantizationType
from tqdm import tqdm

from forerun.distributed.parallel_state import TensorParallelGroup
from forerun.distributed.pipeline_parallel import PipelineStage, prune_to_stage, stage_weights
from forerun.distributed.tensor_parallel import shard_model
from forerun.model.base import CausalLM
from forerun.model.cache import GGUFCacheEntry
from forerun.model.config import ModelConfig
from forerun.model.errors import ModelLoadError
from forerun.model.gguf_file import (
    RawBlocks,
    gguf_weights,
    open_gguf,
    release_gguf_pages,
)
from forerun.model.info import load_model_config
from forerun.model.packed_linear import prepack_supported
from forerun.model.quant import resident_weight_bytes, validate_quantization
from forerun.model.quant.gguf_linear import (
    NATIVE_TYPE_NAMES,
    SUPPORTED_TYPES,
    apply_gguf_blocks,
)
from forerun.model.quant.gguf_moe import apply_gguf_experts
from forerun.model.quant.int8_linear import apply_int8
from forerun.model.registry import get_model_class
from forerun.model.safetensors_weights import (
    count_tensors,
    safetensors_files,
    safetensors_weights,
)
from forerun.model.source import ModelSource, resolve_model
from forerun.model.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "ModelLoadError",
    "ModelSource",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "resolve_model",
]


def _weights(source: ModelSource) -> tuple[Iterable[tuple[str, torch.Tensor]], int]:
    if source.is_gguf:
        path = source.gguf_path
        reader = open_gguf(path)
        return gguf_weights(reader, path), len(reader.tensors)
    files = safetensors_files(source.path)
    return safetensors_weights(files), count_tensors(files)


def _with_progress(
    weights: Iterable[tuple[str, torch.Tensor]], total: int, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    # disable=None hides the bar when stderr is not a terminal (logs, CI).
    with tqdm(total=total, desc=f"Loading {name}", unit="tensor", disable=None) as bar:
        for item in weights:
            yield item
            bar.update(1)


def _load_gguf_blocks(model: CausalLM, source: ModelSource, dtype: torch.dtype,
                      device: torch.device) -> None:
    """quantization="gguf": the file's linears (and embedding) in a type with a native kernel
    (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, IQ4_NL, MXFP4, the K-quants Q2_K-Q6_K and IQ4_XS) keep their
    blocks; every other tensor loads dequantized, as on the exact path, and the log names the
    types that did."""
    if not source.is_gguf:
        raise ModelLoadError(
            f"quantization='gguf' needs a GGUF file, and {source.name} is a Hugging Face "
            "folder; use quantization='int8' or None")
    path = source.gguf_path
    reader = open_gguf(path)
    blocks = RawBlocks(reader, set(SUPPORTED_TYPES), device)
    used = apply_gguf_blocks(model, blocks, dtype) | apply_gguf_experts(model, blocks)
    if not any(n.endswith(("_proj.weight", "lm_head.weight")) for n in used):
        raise ModelLoadError(
            f"quantization='gguf': {path.name} has no linear weights in a type run natively "
            "(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL or MXFP4, the K-quants Q2_K to Q6_K or "
            "IQ4_XS; other GGUF types load dequantized with quantization=None)")
    # Every tensor type (float32 aside) held dequantized rather than in its blocks: its type
    # has no kernel here, or it is part of a fused linear with a part that has none.
    left = Counter(GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors
                   if int(t.tensor_type) != int(GGMLQuantizationType.F32))
    left.subtract(Counter(NATIVE_TYPE_NAMES[blocks.qtype(n)] for n in used))
    if +left:
        logger.info("quantization=gguf: tensors loaded dequantized (not run in their blocks): "
                    "%s", ", ".join(f"{name} x {count}" for name, count in sorted((+left).items())))
    else:
        logger.info("quantization=gguf: every quantized tensor of %s runs in its blocks",
                    path.name)
    weights = gguf_weights(reader, path, skip=frozenset(used))
    model.load_weights(_with_progress(weights, len(reader.tensors) - len(used), source.name))
    release_gguf_pages(reader)


def load_model(
    source: ModelSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
    quantization: str | None = None, tensor_parallel: TensorParallelGroup | None = None,
    pipeline_stage: PipelineStage | None = None, expert_parallel: bool = False,
) -> CausalLM:
    """Build the model for ``config`` on ``device`` in ``dtype`` and load its weights;
    ``quantization`` (None, "gguf" or "int8": :mod:`forerun.model.quant`) picks how the
    linear weights are held; with ``tensor_parallel`` the model keeps this rank's share
    (:mod:`forerun.distributed.tensor_parallel`), with ``pipeline_stage`` only that stage's
    layers (:mod:`forerun.distributed.pipeline_parallel`); ``expert_parallel`` splits a
    mixture of experts' layers by whole experts over the tensor-parallel ranks."""
    quantization = validate_quantization(quantization)
    cls = get_model_class(config.architecture)
    # Build on the meta device so no time is spent on random init that weights overwrite.
    with torch.device("meta"):
        model = cls(config)
    if pipeline_stage is not None:
        if quantization is not None:
            raise ValueError("pipeline_parallel_size > 1 runs unquantized weights only; "
                             f"got quantization={quantization!r}")
        prune_to_stage(model, pipeline_stage)
    model = model.to(dtype=dtype).to_empty(device=device)
    entry = GGUFCacheEntry.for_source(source)
    rename = pipeline_stage.local_name if pipeline_stage is not None else None
    if quantization == "gguf":
        # The cache holds dequantized weights; here the blocks come from the file itself.
        _load_gguf_blocks(model, source, dtype, device)
    elif entry is not None and entry.load_weights(model, rename):
        logger.info("weights of %s read from the cache %s", source.name, entry.folder)
    else:
        weights, total = _weights(source)
        if pipeline_stage is not None:
            weights = stage_weights(model, pipeline_stage, weights)
        model.load_weights(_with_progress(weights, total, source.name))
        if source.is_gguf:
            release_gguf_pages(open_gguf(source.gguf_path))
        if entry is not None and pipeline_stage is None:  # the cache holds whole models
            entry.save_weights(model)
    model.eval()
    if tensor_parallel is not None and tensor_parallel.size > 1:
        # GGUF blocks are split in their blocks; int8 is applied below to this rank's
        # share: the row-parallel linears' scales are then those of its input columns.
        shard_model(model, tensor_parallel, expert_parallel)
    if quantization == "int8":
        logger.info("quantization=int8: %d linear weights quantized per output channel",
                    apply_int8(model))
    if prepack_supported(dtype, device, quantization):
        logger.info("%d linear weights reordered for oneDNN", model.prepack())
    model.resident_weight_bytes = resident_weight_bytes(model)
    logger.info(
        "loaded %s (%s, %s) as %s on %s, quantization=%s: %.1f MiB of weights resident",
        source.name, config.architecture,
        f"{config.num_hidden_layers} layers" if pipeline_stage is None else
        f"layers {pipeline_stage.start_layer}-{pipeline_stage.end_layer - 1} of "
        f"{config.num_hidden_layers}", dtype, device, quantization,
        model.resident_weight_bytes / 2**20,
    )
    return model
