"""The interface every forerun model implements, plus shared weight loading."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from forerun.model.attention import AttentionMetadata, KVCache
from forerun.model.config import ModelConfig
from forerun.model.errors import ModelLoadError

if TYPE_CHECKING:
    from forerun.distributed.pipeline_parallel import PipelineStage

logger = logging.getLogger(__name__)

# (fused parameter's module name, row offset, row count) for one checkpoint projection.
Shard = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class WeightSlot:
    """Where one checkpoint tensor goes: the parameter ``param``, in it entry ``index`` of
    the first dimension (an expert of a stacked MoE weight), then ``rows`` (offset, count)
    of dimension ``rows_dim`` of what remains (a projection of a fused one: dimension 1 for
    every expert's gate or up rows at once); None: the whole."""

    param: str
    index: int | None = None
    rows: tuple[int, int] | None = None
    rows_dim: int = 0


class CausalLM(nn.Module):
    """A decoder-only language model running over a flat token batch and a paged KV cache.

    Subclasses name their parameters like the Hugging Face checkpoints, except for fused
    projections, which ``packed_shards`` describes so that ``load_weights`` can fill them.
    """

    config: ModelConfig
    # Bytes of weights held (every form, each storage once); set by the loader.
    resident_weight_bytes: int = 0
    # Pipeline parallel: the layers this model holds (None: all of them); set by the loader.
    pp_stage: PipelineStage | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` for the flat batch ``input_ids``/``positions`` ``[T]``.

        A pipeline stage other than the first starts from the previous stage's
        ``intermediate`` (``[2, T, hidden]``: hidden state and residual) instead of the ids;
        a stage other than the last returns its own ``intermediate``.
        """
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for the selected hidden rows ``[N, hidden]``."""
        raise NotImplementedError

    def prepack(self) -> int:
        """Put linear weights into the CPU matmul library's layout once; returns how many.

        Called after the weights are loaded, only where ``prepack_supported`` says so.
        """
        return 0

    def packed_shards(self) -> dict[str, Shard]:
        """Checkpoint module name (e.g. ``q_proj``) -> where it lives in a fused parameter."""
        return {}

    def skip_weight(self, name: str) -> bool:
        """True for checkpoint tensors that are deliberately not loaded."""
        return name.endswith("rotary_emb.inv_freq")

    def weight_slot(self, name: str) -> WeightSlot:
        """Where checkpoint tensor ``name`` loads (fused projections: ``packed_shards``)."""
        for key, (fused, offset, size) in self.packed_shards().items():
            marker = f".{key}."
            if marker in name:
                return WeightSlot(name.replace(marker, f".{fused}."), rows=(offset, size))
        return WeightSlot(name)

    def names_loaded_by(self, name: str) -> set[str]:
        """The expected checkpoint names that tensor ``name`` provides (itself, except a
        stacked MoE tensor, which stands for every expert's)."""
        return {name}

    def expected_weight_names(self) -> set[str]:
        """Checkpoint names that must all be present for the model to be complete."""
        by_fused: dict[str, list[str]] = {}
        for key, (fused, _, _) in self.packed_shards().items():
            by_fused.setdefault(fused, []).append(key)
        names: set[str] = set()
        for pname, _ in self.named_parameters():
            module_name = pname.rsplit(".", 2)[-2] if pname.count(".") >= 1 else ""
            if module_name in by_fused:
                for key in by_fused[module_name]:
                    names.add(pname.replace(f".{module_name}.", f".{key}."))
            else:
                names.add(pname)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, checking shapes."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            slot = self.weight_slot(name)
            param = params.get(slot.param)
            if param is None:
                unexpected.append(name)
                continue
            dst = param.data if slot.index is None else param.data[slot.index]
            if slot.rows is not None:
                dst = dst.narrow(slot.rows_dim, slot.rows[0], slot.rows[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            seen |= self.names_loaded_by(name)
        if unexpected:
            logger.warning(
                "ignored %d unexpected weights, e.g. %s", len(unexpected), unexpected[:5]
            )
        missing = sorted(self.expected_weight_names() - seen)
        if missing:
            shown = ", ".join(missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing {len(missing)} weights: {shown}{more}")
