"""The offloading connector: the prefix cache continued into host RAM and onto disk."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from forerun.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from forerun.kv_connector.offload_store import OffloadStore
from forerun.kv_connector.offloading_scheduler import (
    OffloadingConnectorMetadata,
    OffloadingConnectorScheduler,
)
from forerun.kv_connector.offloading_worker import OffloadingConnectorWorker

if TYPE_CHECKING:
    import torch

    from forerun.core.output import SchedulerOutput
    from forerun.request import Request


class OffloadingConnector(KVConnectorBase):
    """Full blocks of ended requests are saved (asynchronously) to a RAM tier and through
    it to a disk tier; a request whose prefix continues in the store past the device
    cache's hit waits in WAITING_FOR_REMOTE_KVS while its blocks are loaded back.

    The two halves share one :class:`OffloadStore` (the engine and its worker thread are one
    process): the scheduler half asks it what it holds, the worker half moves the bytes.
    """

    def __init__(self, role: KVConnectorRole, store: OffloadStore, block_size: int) -> None:
        super().__init__(role)
        self.store = store
        self.scheduler = (OffloadingConnectorScheduler(store, block_size)
                          if role == KVConnectorRole.SCHEDULER else None)
        self.worker = OffloadingConnectorWorker(store) if role == KVConnectorRole.WORKER \
            else None

    def _sched(self) -> OffloadingConnectorScheduler:
        assert self.scheduler is not None, "a scheduler-side call on the worker half"
        return self.scheduler

    def _work(self) -> OffloadingConnectorWorker:
        assert self.worker is not None, "a worker-side call on the scheduler half"
        return self.worker

    # ----- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # ----- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadingConnectorMetadata)
        self._work().start_load_kv(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._work().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def wait_for_transfers(self, timeout_s: float) -> None:
        self._work().wait_for_transfers(timeout_s)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
