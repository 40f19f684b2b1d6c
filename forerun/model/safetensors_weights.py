"""Iterating the tensors of a Hugging Face safetensors checkpoint (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from forerun.model.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint shards of ``folder``: from the index when present, else every file."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"could not read {index}: {exc}") from exc
        files = [folder / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} lists missing shards: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {folder} has no *.safetensors weights")
    return files


def count_tensors(files: list[Path]) -> int:
    """Total number of tensors in the shards (reads headers only)."""
    total = 0
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                total += len(sf.keys())
        except Exception as exc:  # safetensors raises its own error type on corrupt headers
            raise ModelLoadError(f"could not read safetensors file {f}: {exc}") from exc
    return total


def safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard."""
    for f in files:
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    tensor = sf.get_tensor(name)
                    yield name, tensor
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"could not read safetensors file {f}: {exc}") from exc
