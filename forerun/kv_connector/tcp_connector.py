"""The prefill/decode connector: a producer's prompt KV pulled over TCP by a consumer.

``--kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}'`` on
the prefill instance, ``"kv_consumer"`` on the decode one (``kv_both`` does either, per
request), and ``forerun disagg-proxy`` in front (forerun/server/disagg_proxy.py).

- Producer: a request sent with ``kv_transfer_params: {"do_remote_decode": true}`` runs as
  usual (the proxy asks for one token). When it finishes, :meth:`request_finished` holds
  its blocks, offers the full blocks before its last prompt token on this engine's block
  server (tcp_transport.py) and answers the ``kv_transfer_params`` the consumer needs:
  where to connect, which request, how many prompt tokens. The blocks are freed when the
  consumer acknowledges its read, or when the offer expires (``offer_timeout_s``).
- Consumer: a request with ``do_remote_prefill`` asks for those blocks past its own prefix
  cache hit; it waits in WAITING_FOR_REMOTE_KVS holding fresh blocks while a worker thread
  pulls them (other requests keep running), then is admitted with them as a prefix-cache
  hit and computes only the last (partial) block of its prompt. A failed pull (the
  producer died, the offer expired, the layout differs) marks the blocks invalid: the
  request recomputes its prompt, and nothing else is affected.

Only full blocks cross, so the producer's blocks offered never include a position that a
step still in flight (async scheduling's placeholder for the next token) may write.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forerun.kv_connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from forerun.kv_connector.tcp_transport import KVBlockServer, TransferError, pull_blocks

if TYPE_CHECKING:
    import torch

    from forerun.core.output import SchedulerOutput
    from forerun.request import Request

logger = logging.getLogger(__name__)

_FINISHED_OK = ("stop", "length")


@dataclass(slots=True)
class PullSpec:
    """One consumer request's pull: the producer's blocks from ``first_block`` into ours."""

    request_id: str
    host: str
    port: int
    remote_request_id: str
    first_block: int
    block_ids: list[int]


@dataclass(slots=True)
class TCPConnectorMetadata(KVConnectorMetadata):
    """The pulls a step starts."""

    pulls: list[PullSpec] = field(default_factory=list)


@dataclass(slots=True)
class TCPConnectorShared:
    """What both halves of one engine's connector share (they live in one process)."""

    role: str
    block_size: int
    fingerprint: str
    server: KVBlockServer | None
    advertise_host: str
    pull_timeout_s: float
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


def _wanted(request: Request, producer_tokens: int, block_size: int) -> int:
    """Prompt positions a consumer takes from the producer: whole blocks, and never the
    last prompt token (its logits start the decode)."""
    n = min(producer_tokens, request.num_prompt_tokens) - 1
    return max(0, n) // block_size * block_size


class TCPConnector(KVConnectorBase):
    """Prefill/decode disaggregation over TCP (see the module docstring)."""

    def __init__(self, role: KVConnectorRole, shared: TCPConnectorShared) -> None:
        super().__init__(role)
        self.shared = shared
        # Scheduler half: pulls decided since the last step's metadata.
        self._pending: list[PullSpec] = []
        # Worker half: pulls in flight and their outcomes.
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="forerun-kv-pull") \
            if role == KVConnectorRole.WORKER else None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._in_flight: dict[str, Future[int]] = {}
        self._recved: set[str] = set()
        self._failed_blocks: set[int] = set()

    @property
    def _consumes(self) -> bool:
        return self.shared.role in ("kv_consumer", "kv_both")

    @property
    def _produces(self) -> bool:
        return self.shared.role in ("kv_producer", "kv_both")

    # ----- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (self._consumes and params and params.get("do_remote_prefill")):
            return 0, False
        try:
            producer_tokens = int(params["num_tokens"])
        except (KeyError, TypeError, ValueError):
            return 0, False
        wanted = _wanted(request, producer_tokens, self.shared.block_size)
        return max(0, wanted - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        bs = self.shared.block_size
        first = request.num_computed_tokens // bs
        count = num_external_tokens // bs
        try:
            spec = PullSpec(request.request_id, str(params["remote_host"]),
                            int(params["remote_port"]), str(params["remote_request_id"]),
                            first, list(block_ids[0][first:first + count]))
        except (KeyError, TypeError, ValueError):
            # Malformed params: the pull fails at once and the prompt is recomputed.
            spec = PullSpec(request.request_id, "", 0, "", first,
                            list(block_ids[0][first:first + count]))
        # Each pull happens once per request life: the params are consumed here.
        request.kv_transfer_params = None
        self._pending.append(spec)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._pending = TCPConnectorMetadata(self._pending), []
        return meta

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        server = self.shared.server
        if not (self._produces and server is not None and params
                and params.get("do_remote_decode")):
            return False, None
        if request.get_finished_reason() not in _FINISHED_OK:
            return False, None  # aborted: nobody will read it
        n = _wanted(request, request.num_prompt_tokens, self.shared.block_size)
        blocks = list(block_ids[0][: n // self.shared.block_size])
        if not blocks:
            return False, {"do_remote_prefill": False}  # too short to be worth a transfer
        server.offer(request.request_id, blocks)
        return True, {"do_remote_prefill": True, "remote_engine_id": self.shared.engine_id,
                      "remote_host": self.shared.advertise_host, "remote_port": server.port,
                      "remote_request_id": request.request_id,
                      "num_tokens": request.num_prompt_tokens}

    # ----- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._kv_caches = list(kv_caches)
        if self.shared.server is not None:
            self.shared.server.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, TCPConnectorMetadata) and self._pool is not None
        for spec in metadata.pulls:
            fut = self._pool.submit(self._pull, spec)
            with self._lock:
                self._in_flight[spec.request_id] = fut
            fut.add_done_callback(lambda f, s=spec: self._pulled(s, f))

    def _pull(self, spec: PullSpec) -> int:
        if not spec.block_ids:
            return 0
        return pull_blocks(spec.host, spec.port, spec.remote_request_id,
                           self.shared.fingerprint, spec.first_block, spec.block_ids,
                           self._kv_caches, self.shared.pull_timeout_s)

    def _pulled(self, spec: PullSpec, fut: Future[int]) -> None:
        error = fut.exception()
        with self._wake:
            self._in_flight.pop(spec.request_id, None)
            self._recved.add(spec.request_id)
            if error is not None:
                logger.warning("request %s: KV pull from %s:%d failed (%s); its prompt is "
                               "recomputed", spec.request_id, spec.host, spec.port,
                               error if isinstance(error, TransferError | OSError)
                               else repr(error))
                self._failed_blocks.update(spec.block_ids)
            self._wake.notify_all()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            recved, self._recved = self._recved, set()
        sent = self.shared.server.take_done() if self.shared.server is not None else set()
        return sent, recved

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_transfers(self, timeout_s: float) -> None:
        with self._wake:
            if self._in_flight and not self._recved:
                self._wake.wait(timeout_s)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.shared.server is not None and self.role == KVConnectorRole.WORKER:
            self.shared.server.close()
