"""The scheduler half of the offloading connector: lookups, and which blocks to move."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forerun.kv_connector.base import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from forerun.core.output import SchedulerOutput
    from forerun.kv_connector.offload_store import OffloadStore
    from forerun.request import Request


@dataclass(slots=True)
class BlockTransfer:
    """One request's blocks to move: device block ids and their chain hashes, in order."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass(slots=True)
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """One step's transfers: loads (store -> device blocks) and saves (device -> store)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class OffloadingConnectorScheduler:
    """Finds prefix hits past the device cache in the store, and saves a request's full,
    computed blocks that the store lacks when the request ends.

    A request has at most one transfer in flight: a load (while it waits in
    WAITING_FOR_REMOTE_KVS) or, once it ended, a save; that transfer's report is what lets
    the scheduler release the blocks it holds.
    """

    def __init__(self, store: OffloadStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._pending_loads: list[BlockTransfer] = []
        self._pending_saves: list[BlockTransfer] = []
        self._loading: set[str] = set()  # loads sent to the worker, not yet reported
        self._saving: dict[str, list[bytes]] = {}  # saves not yet reported, and their hashes
        self._saving_hashes: set[bytes] = set()
        # Tokens supplied from the store (the hit counters' connector share).
        self.num_loaded_tokens = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        n = 0
        for h in request.block_hashes[start:end]:
            if not self.store.contains(h):
                break
            n += 1
        return (n * bs, True) if n else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        (ids,) = block_ids  # one KV cache group (the connector refuses more)
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        self._pending_loads.append(BlockTransfer(
            request.request_id, ids[start:end], list(request.block_hashes[start:end])))
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> OffloadingConnectorMetadata:
        meta = OffloadingConnectorMetadata(self._pending_loads, self._pending_saves)
        self._loading.update(t.req_id for t in self._pending_loads)
        self._pending_loads, self._pending_saves = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._loading -= connector_output.finished_recving
        for req_id in connector_output.finished_sending:
            self._saving_hashes.difference_update(self._saving.pop(req_id, ()))

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._loading:
            return True, None  # the worker still writes its blocks
        # A load not sent yet is dropped: nothing touched the blocks.
        self._pending_loads = [t for t in self._pending_loads if t.req_id != req_id]
        if not block_ids or not block_ids[0]:
            return False, None
        (ids,) = block_ids
        # Full blocks whose every position is computed (or enqueued: the save runs after the
        # steps in flight on the worker's FIFO), under the request's own hashes.
        end = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size,
                  len(request.block_hashes), len(ids))
        save_ids, save_hashes = [], []
        for i in range(end):
            h = request.block_hashes[i]
            if h in self._saving_hashes or self.store.contains(h):
                continue
            save_ids.append(ids[i])
            save_hashes.append(h)
        if not save_ids:
            return False, None
        self._pending_saves.append(BlockTransfer(req_id, save_ids, save_hashes))
        self._saving[req_id] = save_hashes
        self._saving_hashes.update(save_hashes)
        return True, None
