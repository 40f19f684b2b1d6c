"""The worker half of the offloading connector: copies between device blocks and the store
on a transfer thread of its own, so no step waits for a save or a load."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from forerun.kv_connector.offload_store import OffloadStore
from forerun.kv_connector.offloading_scheduler import BlockTransfer, OffloadingConnectorMetadata

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def block_bytes_of(kv_caches: KVCaches) -> int:
    """Bytes of one block over every layer's K and V."""
    return sum(t[0].numel() * t.element_size() for layer in kv_caches for t in layer)


class OffloadingConnectorWorker:
    """Runs the step's transfers in order on one thread.

    A save gathers each block into a flat host tensor, puts it in the RAM tier, reports the
    request (its device blocks may now be freed) and then writes the blocks through to disk.
    A load fills each block from the store; a block the store no longer has (evicted, or a
    corrupt file) and every block after it are reported invalid.
    """

    def __init__(self, store: OffloadStore) -> None:
        self.store = store
        self.kv_caches: KVCaches = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forerun-kv-offload")
        self._lock = threading.Lock()
        self._any_done = threading.Event()
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._invalid: set[int] = set()
        self._jobs: list[Future[None]] = []
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        self.kv_caches = kv_caches
        have = block_bytes_of(kv_caches)
        if have != self.store.block_bytes:
            raise ValueError(f"KV offload: the store holds blocks of {self.store.block_bytes} "
                             f"bytes but this cache's are {have}")

    def start_load_kv(self, meta: OffloadingConnectorMetadata) -> None:
        if not (meta.saves or meta.loads):
            return
        ready = None
        if self.kv_caches and self.kv_caches[0][0].is_cuda:
            # The transfer thread's copies must see every write queued before this step.
            ready = torch.cuda.Event()
            ready.record()
        self._jobs = [j for j in self._jobs if not j.done()]
        for t in meta.saves:
            self._jobs.append(self._pool.submit(self._save, t, ready))
        for t in meta.loads:
            self._jobs.append(self._pool.submit(self._load, t, ready))

    def _payload(self, block_id: int) -> torch.Tensor:
        parts = [t[block_id].reshape(-1) for layer in self.kv_caches for t in layer]
        return torch.cat(parts).to("cpu").view(torch.uint8)

    def _fill(self, block_id: int, payload: torch.Tensor) -> None:
        dtype = self.kv_caches[0][0].dtype
        flat = payload.view(dtype).to(self.kv_caches[0][0].device)
        offset = 0
        for layer in self.kv_caches:
            for t in layer:
                dst = t[block_id]
                dst.copy_(flat[offset:offset + dst.numel()].view_as(dst))
                offset += dst.numel()

    def _save(self, t: BlockTransfer, ready: torch.cuda.Event | None) -> None:
        payloads = []
        try:
            if ready is not None:
                ready.synchronize()
            with torch.inference_mode():
                for bid, h in zip(t.block_ids, t.block_hashes, strict=True):
                    payload = self._payload(bid)
                    self.store.put_ram(h, payload)
                    payloads.append((h, payload))
            self.num_saved_blocks += len(payloads)
        except Exception:  # a failed save only loses the offload, never the request
            logger.exception("KV offload: saving %s failed", t.req_id)
        finally:
            self._done(sent=t.req_id)
        for h, payload in payloads:
            self.store.put_disk(h, payload)

    def _load(self, t: BlockTransfer, ready: torch.cuda.Event | None) -> None:
        invalid: list[int] = []
        try:
            if ready is not None:
                ready.synchronize()
            with torch.inference_mode():
                for i, (bid, h) in enumerate(zip(t.block_ids, t.block_hashes, strict=True)):
                    payload = self.store.get(h)
                    if payload is None or payload.numel() != self.store.block_bytes:
                        invalid = t.block_ids[i:]
                        break
                    self._fill(bid, payload)
                    self.num_loaded_blocks += 1
        except Exception:
            logger.exception("KV offload: loading %s failed; recomputing", t.req_id)
            invalid = list(t.block_ids)
        finally:
            self._done(recved=t.req_id, invalid=invalid)

    def _done(self, sent: str | None = None, recved: str | None = None,
              invalid: list[int] | None = None) -> None:
        with self._lock:
            if sent is not None:
                self._sent.add(sent)
            if recved is not None:
                self._recved.add(recved)
            if invalid:
                self._invalid.update(invalid)
        self._any_done.set()

    def has_pending(self) -> bool:
        return any(not j.done() for j in self._jobs)

    def wait_for_transfers(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for some transfer to finish (an idle engine polls)."""
        if not self._any_done.is_set() and self.has_pending():
            self._any_done.wait(timeout_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            sent, recved = self._sent, self._recved
            self._sent, self._recved = set(), set()
            self._any_done.clear()
        return sent, recved

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        """Let the queued saves (and their disk writes) finish."""
        self._pool.shutdown(wait=True)
