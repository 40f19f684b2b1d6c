"""KV connectors: KV blocks that come from, or go to, somewhere other than the device pool.

``base.py`` is the interface (vLLM's KVConnectorBase_V1 shape, both roles); ``factory.py``
builds one from ``EngineConfig.kv_transfer_config``; the offloading connector (host RAM and
disk tiers for the prefix cache) is ``offloading_connector.py`` with its halves in
``offloading_scheduler.py`` / ``offloading_worker.py`` and its storage in ``offload_store.py``
(``ram_tier.py``, ``disk_tier.py``). See docs/kv_connector.md.
"""
