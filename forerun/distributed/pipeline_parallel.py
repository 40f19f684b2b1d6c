"""Pipeline parallelism for the Llama family: each stage holds a contiguous range of layers.

The first stage embeds the tokens, the last applies the final norm and the output head and
samples; between stages travel the hidden state and the residual of the stage's last layer
(one ``[2, tokens, hidden]`` tensor). A stage's model keeps only its own layers, numbered
from 0 (so its KV cache has one entry per layer it holds); checkpoint names are renumbered
on load, and weights of other stages are not kept.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from forerun.model.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """The layers one pipeline stage runs: ``[start_layer, end_layer)`` of ``num_layers``."""

    stage: int
    num_stages: int
    start_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_stage_layers(self) -> int:
        return self.end_layer - self.start_layer

    def local_name(self, name: str) -> str | None:
        """A checkpoint name as this stage's model calls it; None for other stages' layers."""
        m = _LAYER.match(name)
        if m is None:
            return name
        i = int(m.group(1))
        if not self.start_layer <= i < self.end_layer:
            return None
        return f"model.layers.{i - self.start_layer}.{name[m.end():]}"


def check_pipeline_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a split the model cannot take, naming the flag."""
    if size > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={size} is more stages than the model has "
                         f"layers ({config.num_hidden_layers}); use at most "
                         f"{config.num_hidden_layers}")


def stage_layers(num_layers: int, num_stages: int, stage: int) -> PipelineStage:
    """Contiguous ranges as even as possible; the first stages take the extra layers, so
    the last stage, which also runs the output head and sampling, is never the longest."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    end = start + base + (1 if stage < extra else 0)
    return PipelineStage(stage, num_stages, start, end)


def prune_to_stage(model: nn.Module, stage: PipelineStage) -> None:
    """Drop every module this stage does not run (call on the meta device, before the
    weights are allocated)."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList(layers[stage.start_layer: stage.end_layer])
    tied = model.lm_head is None
    if not (stage.is_first or (stage.is_last and tied)):
        model.model.embed_tokens = None
    if not stage.is_last:
        model.model.norm = None
        model.lm_head = None
    model.pp_stage = stage
    # The one-call small-batch path runs every layer from the embedding to the norm.
    model.small_batch.available = False


def stage_weights(model: nn.Module, stage: PipelineStage,
                  weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors this stage's model holds, under its own layer numbers."""
    params = {name for name, _ in model.named_parameters()}
    for name, tensor in weights:
        local = stage.local_name(name)
        if local is None:
            continue
        target = model.weight_slot(local).param
        if target in params or model.skip_weight(local):
            yield local, tensor
