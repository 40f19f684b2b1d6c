"""A step's flat inputs: token ids, positions, KV slots and the attention metadata.

Every scheduled request contributes its ``num_scheduled_tokens`` positions from its own
``num_computed_tokens`` on. With async scheduling the newest position of a decoding request
is a *placeholder*: the token there is the request's previous sample, which never came back
to the host. Its flat row gets a 0 here and is listed in :class:`Placeholders`, whose
:meth:`~Placeholders.fill` scatters the sample from ``last_sampled`` on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from forerun.core.output import SchedulerOutput
from forerun.model.attention import AttentionMetadata
from forerun.worker.request_state import CachedRequestState


@dataclass(slots=True)
class Placeholders:
    """Flat rows whose input is a sample still on the device, and where each one is."""

    rows: list[int] = field(default_factory=list)  # rows of the flat input
    slots: list[int] = field(default_factory=list)  # rows of last_sampled
    req_ids: list[str] = field(default_factory=list)

    def fill(self, input_ids: torch.Tensor, last_sampled: torch.Tensor) -> None:
        """Scatter the samples into ``input_ids``, on the device (no host round trip)."""
        if self.rows:
            dev = input_ids.device
            rows = torch.tensor(self.rows, dtype=torch.long, device=dev)
            input_ids[rows] = last_sampled[torch.tensor(self.slots, device=dev)]


@dataclass(slots=True)
class PoolChunk:
    """One pooling request's positions in a step: flat rows ``row .. row + n - 1`` hold
    its prompt positions ``start .. start + n - 1``; ``last`` when they end the prompt."""

    req_id: str
    row: int
    n: int
    start: int
    last: bool


@dataclass(slots=True)
class StepInputs:
    """The flat inputs of one step, as :func:`prepare_inputs` builds them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # flat rows whose logits are sampled
    sample_req_ids: list[str]
    sample_slots: torch.Tensor
    drafts: list[list[int]] | None  # with a drafter: per sampling request, its drafts
    num_tokens_of: dict[str, int]  # tokens computed per request (drafts found, not reserved)
    placeholders: Placeholders  # rows still 0 in input_ids until filled
    pool_chunks: list[PoolChunk] = field(default_factory=list)  # pooling requests' rows


def prepare_inputs(requests: dict[str, CachedRequestState], so: SchedulerOutput,
                   req_ids: list[str], block_size: int, device: torch.device,
                   with_drafts: bool, layer_groups: list[int] | None = None) -> StepInputs:
    """Build the step's inputs and advance each request's ``num_computed_tokens`` (and,
    where it samples, ``last_sampled_pos``). Placeholders are left unfilled.

    ``layer_groups``: with several KV cache groups, each layer's group; every group gets
    its own block table and slot mapping over the same positions (``meta.for_layer``)."""
    num_groups = 1 if layer_groups is None else max(layer_groups) + 1
    flat = _FlatBatch(drafts=[] if with_drafts else None,
                      slots=[[] for _ in range(num_groups)],
                      tables=[[] for _ in range(num_groups)])
    spec = so.scheduled_spec_decode_tokens
    for req_id in req_ids:
        flat.add(requests[req_id], so.num_scheduled_tokens[req_id], spec.get(req_id, 0),
                 block_size)
    return flat.to_inputs(block_size, device, layer_groups)


@dataclass(slots=True)
class _FlatBatch:
    """The host lists one step's inputs are built from, request after request."""

    drafts: list[list[int]] | None
    # Per KV cache group: the flat rows' slots, and each request's block table.
    slots: list[list[int]]
    tables: list[list[list[int]]]
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sample_req_ids: list[str] = field(default_factory=list)
    sample_slots: list[int] = field(default_factory=list)
    num_tokens_of: dict[str, int] = field(default_factory=dict)
    placeholders: Placeholders = field(default_factory=Placeholders)
    pool_chunks: list[PoolChunk] = field(default_factory=list)

    def add(self, state: CachedRequestState, n: int, num_spec: int, bs: int) -> None:
        """Append one request's ``n`` scheduled positions (``num_spec`` of them reserved
        for drafts)."""
        start = state.num_computed_tokens
        known = len(state.token_ids)
        drafts: list[int] = []
        if num_spec:
            # The scheduler reserved num_spec draft positions; verify the drafts the
            # drafter has (it may have found fewer), at this side's own positions.
            drafts = state.spec_token_ids[:num_spec]
            n = n - num_spec + len(drafts)
        end = start + n
        row0 = len(self.token_ids)
        self._add_token_ids(state, start, end, drafts)
        self.positions.extend(range(start, end))
        # The same positions in every KV cache group, at that group's block ids.
        if n == 1:
            index, offset = start // bs, start % bs
            for slots, tables, blocks in zip(self.slots, self.tables, state.block_ids,
                                             strict=True):
                slots.append(blocks[index] * bs + offset)
                tables.append(blocks)
        else:
            pos = np.arange(start, end)
            index, offset = pos // bs, pos % bs
            for slots, tables, blocks in zip(self.slots, self.tables, state.block_ids,
                                             strict=True):
                slots.extend((np.asarray(blocks)[index] * bs + offset).tolist())
                tables.append(blocks)
        self.query_start_loc.append(self.query_start_loc[-1] + n)
        self.num_tokens_of[state.req_id] = n
        self.seq_lens.append(end)
        state.num_computed_tokens = end
        if state.pooling_params is not None:  # pooled, never sampled
            self.pool_chunks.append(PoolChunk(state.req_id, row0, n, start, end >= known))
            return
        if end - len(drafts) >= known:  # reached the end of the sequence: this step samples
            self.logits_rows.extend(range(row0 + n - 1 - len(drafts), row0 + n))
            self.sample_req_ids.append(state.req_id)
            self.sample_slots.append(state.slot)
            state.last_sampled_pos = end
            if self.drafts is not None:
                self.drafts.append(drafts)

    def _add_token_ids(self, state: CachedRequestState, start: int, end: int,
                       drafts: list[int]) -> None:
        known = len(state.token_ids)
        if drafts:
            assert end - len(drafts) == known, (state.req_id, start, end - start, known)
            self.token_ids.extend(state.token_ids[start:known])
            self.token_ids.extend(drafts)
        elif end <= known:
            self.token_ids.extend(state.token_ids[start:end])
        else:
            # Only the newest position can be unknown here, and it is the request's own
            # last sample.
            self.token_ids.extend(state.token_ids[start:known])
            self.token_ids.extend([0] * (end - max(start, known)))
            assert state.last_sampled_pos == end - 1, (state.req_id, state.last_sampled_pos,
                                                       end)
            self.placeholders.rows.append(len(self.token_ids) - 1)
            self.placeholders.slots.append(state.slot)
            self.placeholders.req_ids.append(state.req_id)

    def _meta(self, group: int, bs: int, dev: torch.device) -> AttentionMetadata:
        tables = self.tables[group]
        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        return AttentionMetadata.build(
            self.query_start_loc, self.seq_lens, torch.from_numpy(table),
            torch.tensor(self.slots[group], dtype=torch.long), bs, dev,
        )

    def to_inputs(self, bs: int, dev: torch.device,
                  layer_groups: list[int] | None = None) -> StepInputs:
        input_ids = torch.tensor(self.token_ids, dtype=torch.long, device=dev)
        meta = self._meta(0, bs, dev)
        if layer_groups is not None:
            metas = [meta] + [self._meta(g, bs, dev) for g in range(1, len(self.tables))]
            for other in metas[1:]:
                other.same_batch_as = meta
            meta.layer_metas = [None if g == 0 else metas[g] for g in layer_groups]
        return StepInputs(
            input_ids,
            torch.tensor(self.positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(self.logits_rows, dtype=torch.long, device=dev),
            self.sample_req_ids,
            torch.tensor(self.sample_slots, dtype=torch.long, device=dev),
            self.drafts,
            self.num_tokens_of,
            self.placeholders,
            self.pool_chunks,
        )
