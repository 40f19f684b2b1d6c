"""The offloaded prefix cache: a RAM tier in front of a disk tier, keyed by chain hash."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from forerun.kv_connector.disk_tier import DiskTier
from forerun.kv_connector.ram_tier import RAMTier

logger = logging.getLogger(__name__)


def kv_fingerprint(model_id: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                   head_dim: int, block_size: int, extra: str = "") -> bytes:
    """What a block's bytes depend on besides its tokens: the model, the KV dtype and the
    cache layout. Two engines share offloaded blocks exactly when this is equal."""
    text = (f"forerun-kv-v1|{model_id}|{dtype}|layers={num_layers}|kv_heads={num_kv_heads}|"
            f"head_dim={head_dim}|block={block_size}|{extra}")
    return hashlib.sha256(text.encode()).digest()


class OffloadStore:
    """Block payloads (flat uint8 CPU tensors of ``block_bytes``) by chain hash.

    Saves go to RAM first and then to disk (write-through, so a block RAM evicts is still on
    disk); a read from disk is promoted into RAM. Thread-safe: the scheduler asks
    :meth:`contains` while the worker's transfer thread reads and writes.
    """

    def __init__(self, block_bytes: int, fingerprint: bytes, ram_bytes: int,
                 disk_dir: str | Path | None = None, disk_bytes: int = 8 << 30) -> None:
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.ram = RAMTier(ram_bytes)
        self.disk = DiskTier(disk_dir, fingerprint, disk_bytes) if disk_dir else None
        self._lock = threading.Lock()
        # Hits by tier, in blocks (stats and tests).
        self.num_ram_hits = 0
        self.num_disk_hits = 0
        self.num_misses = 0

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self.ram or (self.disk is not None and block_hash in self.disk)

    def put_ram(self, block_hash: bytes, payload: torch.Tensor) -> None:
        with self._lock:
            self.ram.put(block_hash, payload)

    def put_disk(self, block_hash: bytes, payload: torch.Tensor) -> bool:
        """Write through to disk (outside the lock: only the transfer thread writes)."""
        if self.disk is None:
            return False
        return self.disk.put(block_hash, payload)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The payload, from RAM or else from disk (checked); None when neither has it."""
        with self._lock:
            payload = self.ram.get(block_hash)
            if payload is not None:
                self.num_ram_hits += 1
                return payload
        if self.disk is not None:
            payload = self.disk.get(block_hash, self.block_bytes)
            if payload is not None:
                with self._lock:
                    self.num_disk_hits += 1
                    self.ram.put(block_hash, payload)
                return payload
        with self._lock:
            self.num_misses += 1
        return None
