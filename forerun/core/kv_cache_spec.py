"""KV cache groups: which layers share a block table, and where each layer's KV lives.

Layers are grouped by attention type (full, or sliding with a given window). Every group
has one block table per request and draws its blocks from the one shared pool, so a block
id means the same page size in every group. For that, the groups have EQUAL layer counts
(vLLM's layout): the cache is ``group_size`` KV tensors ("slots") of ``num_blocks`` pages,
and layer ``j`` of every group lives in slot ``j``. Block ``b`` is held by at most one
group at a time, so slot ``j``'s page ``b`` is written by one layer only. A type whose layer
count is not a multiple of ``group_size`` gets a last group with fewer layers; its unused
slots are padding (memory of those pages in those slots that nobody reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forerun.model.config import ModelConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """How a layer uses its KV: full attention, or the last ``sliding_window`` positions
    (its own included)."""

    attention_type: str = FULL_ATTENTION
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.attention_type == SLIDING_ATTENTION:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ValueError(f"a sliding layer needs a window >= 1, got {self.sliding_window}")
        elif self.attention_type != FULL_ATTENTION or self.sliding_window is not None:
            raise ValueError(f"bad KV cache spec {self.attention_type}/{self.sliding_window}")

    @classmethod
    def for_window(cls, window: int | None) -> KVCacheSpec:
        if window is None:
            return cls()
        return cls(SLIDING_ATTENTION, window)

    @property
    def is_sliding(self) -> bool:
        return self.attention_type == SLIDING_ATTENTION


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One group: layers of one spec that share a block table (``len(layer_indices)`` is
    the group size, or less for a padded last group of its type)."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]


def group_layers(windows: Sequence[int | None]) -> list[KVCacheGroupSpec]:
    """Group layers (given each one's window, None for full attention) into equal-size
    groups: full attention first, then sliding windows from the smallest.

    One spec only: one group of every layer (every model today; the manager's fast path).
    Several: the group size is the smallest spec's layer count, so no spec is padded to
    more than one short group (vLLM's choice; e.g. 1 full + 5 sliding layers: six groups
    of one layer, 2 full + 5 sliding: groups of 2 and one sliding group of 1 padded).
    """
    if not windows:
        raise ValueError("a model has at least one layer")
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer, window in enumerate(windows):
        by_spec.setdefault(KVCacheSpec.for_window(window), []).append(layer)
    specs = sorted(by_spec, key=lambda s: (s.is_sliding, s.sliding_window or 0))
    group_size = min(len(layers) for layers in by_spec.values())
    groups = []
    for spec in specs:
        layers = by_spec[spec]
        for i in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(spec, tuple(layers[i:i + group_size])))
    return groups


def kv_cache_groups(model_config: ModelConfig) -> list[KVCacheGroupSpec]:
    """The groups of a model, from ``ModelConfig.layer_window``."""
    n = model_config.num_hidden_layers
    return group_layers([model_config.layer_window(layer) for layer in range(n)])


def one_group(num_layers: int) -> list[KVCacheGroupSpec]:
    """Every layer in one full-attention group: every block kept (what a model without
    sliding layers gets, and what a hybrid one falls back to where the runner has one table)."""
    return [KVCacheGroupSpec(KVCacheSpec(), tuple(range(num_layers)))]


def num_kv_slots(groups: Sequence[KVCacheGroupSpec]) -> int:
    """How many KV tensors (K and V pairs) the cache needs: the largest group's size."""
    return max(len(g.layer_indices) for g in groups)


def layer_kv_slots(groups: Sequence[KVCacheGroupSpec]) -> list[tuple[int, int]]:
    """For each layer, (group id, tensor slot): its block table and its KV tensor."""
    num_layers = sum(len(g.layer_indices) for g in groups)
    out: list[tuple[int, int] | None] = [None] * num_layers
    for gid, group in enumerate(groups):
        for slot, layer in enumerate(group.layer_indices):
            out[layer] = (gid, slot)
    assert all(x is not None for x in out), out
    return out  # type: ignore[return-value]


def kv_bytes_per_block(groups: Sequence[KVCacheGroupSpec], block_size: int,
                       num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one block id stands for: its page in every slot, K and V (padding included,
    since a padded slot's page is allocated whether or not a layer uses it)."""
    return num_kv_slots(groups) * 2 * block_size * num_kv_heads * head_dim * dtype_bytes
