"""The worker half of a KV connector as a test double, for the fake executor.

Transfers finish a scripted number of steps after they start (so loads and saves overlap
steps in flight), saves add their hashes to a :class:`FakeStore`, and a load can find a
stored block gone (scripted), which reports it and every later block invalid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from forerun.kv_connector.base import KVConnectorOutput
from forerun.kv_connector.offloading_scheduler import BlockTransfer, OffloadingConnectorMetadata


@dataclass
class FakeStore:
    """What the offloading connector's scheduler half asks: which hashes are stored."""

    hashes: set[bytes] = field(default_factory=set)

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes


@dataclass
class FakeTransfer:
    kind: str  # "load" or "save"
    transfer: BlockTransfer
    steps_left: int


@dataclass
class FakeConnectorWorker:
    """Runs the metadata's transfers over the next steps; ``lose(h)`` makes a stored block
    unreadable when a load reaches it."""

    store: FakeStore
    seed: int = 0
    lose: Callable[[bytes], bool] | None = None
    pending: list[FakeTransfer] = field(default_factory=list)
    num_loads: int = 0
    num_saves: int = 0
    num_lost: int = 0

    def _delay(self, req_id: str, kind: str) -> int:
        return (hash((self.seed, req_id, kind)) & 0xFF) % 4

    def start(self, meta: OffloadingConnectorMetadata) -> None:
        for t in meta.saves:
            self.pending.append(FakeTransfer("save", t, self._delay(t.req_id, "save")))
        for t in meta.loads:
            self.pending.append(FakeTransfer("load", t, self._delay(t.req_id, "load")))

    def finish_step(self) -> KVConnectorOutput | None:
        out = KVConnectorOutput()
        keep = []
        for x in self.pending:
            if x.steps_left > 0:
                x.steps_left -= 1
                keep.append(x)
                continue
            t = x.transfer
            if x.kind == "save":
                self.store.hashes.update(t.block_hashes)
                out.finished_sending.add(t.req_id)
                self.num_saves += 1
                continue
            for i, h in enumerate(t.block_hashes):
                if self.lose is not None and self.lose(h):
                    self.store.hashes.discard(h)
                    out.invalid_block_ids.update(t.block_ids[i:])
                    self.num_lost += 1
                    break
            out.finished_recving.add(t.req_id)
            self.num_loads += 1
        self.pending = keep
        return None if out.is_empty() else out
