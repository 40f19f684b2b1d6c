"""``--kv-transfer-config``: which connector, in vLLM's KVTransferConfig JSON shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(slots=True)
class KVTransferConfig:
    """``{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {...}}``; unknown keys are refused, naming them.
    ``kv_ip`` / ``kv_port``: where a prefill/decode producer's block server listens (and
    the host it tells consumers; port 0 takes a free one)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> KVTransferConfig | None:
        if not d:
            return None
        unknown = set(d) - {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_ip",
                            "kv_port"}
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown keys {sorted(unknown)}")
        name = d.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise ValueError("kv_transfer_config.kv_connector must name a connector")
        role = d.get("kv_role", "kv_both")
        if role not in _ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {_ROLES}, got {role!r}")
        extra = d.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        ip, port = d.get("kv_ip", "127.0.0.1"), d.get("kv_port", 0)
        if not isinstance(ip, str) or not ip:
            raise ValueError("kv_transfer_config.kv_ip must be a host name or address")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {port!r}")
        return cls(name, role, dict(extra), ip, port)
