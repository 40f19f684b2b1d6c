"""Build both halves of the configured KV connector."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from forerun.kv_connector.base import KVConnectorBase, KVConnectorRole
from forerun.kv_connector.config import KVTransferConfig
from forerun.kv_connector.offload_store import OffloadStore, kv_fingerprint
from forerun.kv_connector.offloading_connector import OffloadingConnector

logger = logging.getLogger(__name__)

CONNECTORS = ("OffloadingConnector", "TCPConnector")


@dataclass(slots=True)
class KVLayout:
    """What a connector must know of the device KV cache (and what its bytes depend on)."""

    model_id: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # What identifies the KV bytes on another machine too: model_id without the path.
    portable_id: str = ""

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.block_size * elem


def make_kv_connectors(config: KVTransferConfig, layout: KVLayout, ram_bytes: int,
                       disk_dir: str | None) -> tuple[KVConnectorBase, KVConnectorBase]:
    """(scheduler half, worker half) of ``config.kv_connector``."""
    if config.kv_connector == "TCPConnector":
        return _tcp_connectors(config, layout)
    if config.kv_connector != "OffloadingConnector":
        raise ValueError(f"kv_transfer_config.kv_connector: unknown connector "
                         f"{config.kv_connector!r} (known: {', '.join(CONNECTORS)})")
    extra = dict(config.kv_connector_extra_config)
    disk_bytes = int(extra.pop("disk_bytes", 8 << 30))
    if extra:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown keys "
                         f"{sorted(extra)} (OffloadingConnector takes disk_bytes)")
    if ram_bytes <= 0 and not disk_dir:
        raise ValueError("OffloadingConnector needs kv_offloading_size > 0 or kv_offload_dir")
    fp = kv_fingerprint(layout.model_id, layout.dtype, layout.num_layers,
                        layout.num_kv_heads, layout.head_dim, layout.block_size)
    store = OffloadStore(layout.block_bytes, fp, ram_bytes, disk_dir, disk_bytes)
    logger.info("KV offloading: %.2f GiB of RAM%s, blocks of %d KiB", ram_bytes / (1 << 30),
                f", disk tier in {store.disk.dir}" if store.disk is not None else "",
                layout.block_bytes >> 10)
    return (OffloadingConnector(KVConnectorRole.SCHEDULER, store, layout.block_size),
            OffloadingConnector(KVConnectorRole.WORKER, store, layout.block_size))


def _tcp_connectors(config: KVTransferConfig, layout: KVLayout
                    ) -> tuple[KVConnectorBase, KVConnectorBase]:
    from forerun.kv_connector.tcp_connector import TCPConnector, TCPConnectorShared
    from forerun.kv_connector.tcp_transport import KVBlockServer
    extra = dict(config.kv_connector_extra_config)
    offer_timeout_s = float(extra.pop("offer_timeout_s", 120.0))
    pull_timeout_s = float(extra.pop("pull_timeout_s", 60.0))
    if extra:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown keys "
                         f"{sorted(extra)} (TCPConnector takes offer_timeout_s, "
                         "pull_timeout_s)")
    if offer_timeout_s <= 0 or pull_timeout_s <= 0:
        raise ValueError("kv_transfer_config: offer_timeout_s and pull_timeout_s must be > 0")
    fp = kv_fingerprint(layout.portable_id or layout.model_id, layout.dtype,
                        layout.num_layers, layout.num_kv_heads, layout.head_dim,
                        layout.block_size).hex()
    server = None
    if config.kv_role in ("kv_producer", "kv_both"):
        try:
            server = KVBlockServer(config.kv_ip, config.kv_port, fp, offer_timeout_s)
        except OSError as e:
            raise ValueError(f"kv_transfer_config: cannot listen on {config.kv_ip}:"
                             f"{config.kv_port}: {e.strerror or e}") from None
    shared = TCPConnectorShared(config.kv_role, layout.block_size, fp, server,
                                config.kv_ip, pull_timeout_s)
    logger.info("prefill/decode over TCP: %s%s", config.kv_role,
                f", serving KV on {config.kv_ip}:{server.port}" if server else "")
    return (TCPConnector(KVConnectorRole.SCHEDULER, shared),
            TCPConnector(KVConnectorRole.WORKER, shared))
