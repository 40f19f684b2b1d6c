"""What the frontend must know about a model, and how big its KV cache is.

These facts come from the model's config alone (no weights), so the API process learns them
without importing the engine's builder or the worker. The worker nodes of a multi-node
engine compute the same numbers from the same config.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forerun.config import EngineConfig
from forerun.core.hybrid_kv_cache_manager import HybridKVCacheManager
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.kv_cache_spec import (
    KVCacheGroupSpec,
    kv_bytes_per_block,
    num_kv_slots,
    one_group,
)
from forerun.model import kv_quant
from forerun.model.cache import GGUFCacheEntry
from forerun.model.config import ModelConfig
from forerun.model.errors import ModelLoadError
from forerun.model.gguf_file import gguf_chat_template, gguf_hf_config, open_gguf
from forerun.model.source import ModelSource, resolve_model, resolve_tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not read {path}: {exc}") from exc


def _gguf_config(source: ModelSource) -> ModelConfig:
    entry = GGUFCacheEntry.for_source(source)
    cached = entry.load_config() if entry is not None else None
    if entry is not None and cached is not None:
        try:
            return ModelConfig.from_hf_dict(cached["config"])
        except Exception as exc:  # a stale or hand-edited entry: rebuild it
            entry.discard_config(exc)
    reader = open_gguf(source.gguf_path)
    hf_config = gguf_hf_config(reader)
    config = ModelConfig.from_hf_dict(hf_config)
    if entry is not None:
        entry.save_config(hf_config, gguf_chat_template(reader))
    return config


def load_model_config(source: ModelSource) -> ModelConfig:
    """Read the model's hyper-parameters from config.json (+generation_config.json) or GGUF."""
    if source.is_gguf:
        return _gguf_config(source)
    config_path = source.path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"model folder {source.path} has no config.json")
    gen_path = source.path / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else None
    return ModelConfig.from_hf_dict(_read_json(config_path), gen)


@dataclass(slots=True)
class ModelInfo:
    """What the frontend must know about the model the core serves."""

    source: ModelSource
    model_config: ModelConfig
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    # Where the tokenizer comes from: the model's own files unless config.tokenizer names
    # another.
    tokenizer_source: ModelSource | None = None

    @property
    def tokenizer_from(self) -> ModelSource:
        return self.tokenizer_source or self.source


def resolve_model_info(config: EngineConfig) -> ModelInfo:
    """The model ``config.model`` names, with ``max_model_len`` checked against it."""
    source = resolve_model(config.model)
    mc = load_model_config(source)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} is larger than the model's "
            f"{mc.max_position_embeddings}")
    # longrope's factor set follows the context the engine serves (rotary.py).
    mc.max_model_len = max_model_len
    tokenizer = resolve_tokenizer(config.tokenizer) if config.tokenizer else None
    return ModelInfo(source, mc, max_model_len, mc.vocab_size, list(mc.eos_token_ids),
                     tokenizer)


def num_kv_blocks(config: EngineConfig, info: ModelInfo, dtype: torch.dtype,
                  device: torch.device,
                  groups: Sequence[KVCacheGroupSpec] | None = None) -> int:
    """Blocks that fit the KV memory budget (or the override), capped at what can be used;
    ``groups``: the KV cache groups (default: one group of every layer)."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    mc, bs = info.model_config, config.block_size
    cache_dtype = config.resolve_kv_cache_dtype(dtype)
    elem = torch.tensor([], dtype=cache_dtype).element_size()
    groups = groups or one_group(mc.num_hidden_layers)
    # A block id is a page in every KV slot; several groups share one more, the null block.
    # A quantized cache adds a float32 scale per (block, head) for K and for V in each slot.
    per_block = (kv_bytes_per_block(groups, bs, mc.num_key_value_heads, mc.head_dim, elem)
                 + num_kv_slots(groups)
                 * kv_quant.scale_bytes_per_block(mc.num_key_value_heads, cache_dtype))
    num_null = 1 if len(groups) > 1 else 0
    # A sliding group holds only its window's blocks of a long sequence.
    probe = (KVCacheManager(1, bs, False) if len(groups) == 1
             else HybridKVCacheManager(groups, 1, bs, False))
    need = probe.max_blocks_per_request(info.max_model_len, config.max_num_batched_tokens)
    budget = config.kv_cache_bytes(device)
    ceiling = config.max_num_seqs * need + 1
    n = min(budget // per_block - num_null, ceiling)
    if n < need:
        raise ValueError(
            f"KV cache memory of {budget} bytes holds {n} blocks, fewer than one sequence of "
            f"max_model_len={info.max_model_len} needs; raise kv_cache_memory_bytes or lower "
            "max_model_len")
    return int(n)
