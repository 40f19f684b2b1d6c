"""The host-RAM tier: block payloads by chain hash, least recently used out first."""

from __future__ import annotations

from collections import OrderedDict

import torch


class RAMTier:
    """At most ``capacity_bytes`` of block payloads (flat uint8 CPU tensors).

    Not thread-safe by itself: :class:`forerun.kv_connector.offload_store.OffloadStore`
    holds the lock.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = max(0, capacity_bytes)
        self.used_bytes = 0
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        payload = self._blocks.get(block_hash)
        if payload is not None:
            self._blocks.move_to_end(block_hash)
        return payload

    def put(self, block_hash: bytes, payload: torch.Tensor) -> bool:
        """Insert (or refresh); evicts from the cold end. False if it can never fit."""
        size = payload.numel()
        if size > self.capacity_bytes:
            return False
        old = self._blocks.pop(block_hash, None)
        if old is not None:
            self.used_bytes -= old.numel()
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.used_bytes -= evicted.numel()
        self._blocks[block_hash] = payload
        self.used_bytes += size
        return True
