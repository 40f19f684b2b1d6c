"""The KV connector interface: a scheduler half and a worker half, as in vLLM.

The scheduler half decides (how many tokens of a request an outside store can supply, which
blocks to save when a request ends) and sends its decisions to the worker in the step's
``SchedulerOutput.kv_connector_metadata``. The worker half moves the bytes and reports, in
``ModelRunnerOutput.kv_connector_output``, which requests' transfers have finished. Nothing
else crosses, so the two halves may live in different processes (a prefill/decode connector
would put a network between a producer's worker half and a consumer's).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from forerun.core.output import SchedulerOutput
    from forerun.request import Request


class KVConnectorRole(enum.Enum):
    """Which half a connector instance is."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """One step's instructions from the scheduler half to the worker half (subclassed)."""


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports with a step's output.

    ``finished_sending``: requests whose saves are done, so their held blocks may be freed.
    ``finished_recving``: requests whose loads are done (successfully or not).
    ``invalid_block_ids``: blocks a load could not fill (a missing or corrupt entry); the
    scheduler recomputes from the first of them.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class KVConnectorBase(ABC):
    """Both halves of a KV connector; each instance is one ``role``.

    Scheduler side (called by :class:`forerun.core.scheduler.Scheduler`):
    :meth:`get_num_new_matched_tokens`, :meth:`update_state_after_alloc`,
    :meth:`build_connector_meta`, :meth:`update_connector_output`, :meth:`request_finished`.
    Worker side (called by the model runner, on the worker thread, in step order):
    :meth:`register_kv_caches`, :meth:`start_load_kv`, :meth:`wait_for_layer_load`,
    :meth:`save_kv_layer`, :meth:`wait_for_save`, :meth:`get_finished`.
    """

    def __init__(self, role: KVConnectorRole) -> None:
        self.role = role

    # ----- scheduler side -----------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (the device prefix-cache hit) that this
        connector can supply, and whether it loads them asynchronously (the request then
        waits in WAITING_FOR_REMOTE_KVS). Never more than leaves the last prompt token to
        compute. Must not change state: the allocation may still fail."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """The request now holds ``block_ids`` (per KV cache group); the first
        ``num_computed_tokens + num_external_tokens`` positions' blocks are to be filled."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the worker half; resets the per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker half's report for one processed step (before the scheduler acts)."""
        return None

    @abstractmethod
    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (any reason). Returns (delay_free, kv_transfer_params): with
        delay_free the scheduler keeps its blocks until :meth:`get_finished` reports the
        request, because a transfer still reads or writes them."""

    # ----- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The runner's per-layer (K, V) caches, once, before the first step."""
        return None

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's transfers (called before the step's forward)."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until synchronous loads for this layer are in (asynchronous ones never
        overlap a forward that reads them: their requests are not scheduled)."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """Start saving one layer's new KV during the forward (layer-wise connectors)."""
        return None

    def wait_for_save(self) -> None:
        """Block until the step's layer-wise saves may no longer read the device KV."""
        return None

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids since the last call."""

    def wait_for_transfers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a transfer to finish: a step that scheduled no
        tokens calls this, so an engine waiting only on transfers does not spin."""
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose loads failed since the last call (the scheduler recomputes them)."""
        return set()

    def shutdown(self) -> None:
        """Finish or drop outstanding work (writes in flight to a disk tier finish)."""
        return None
