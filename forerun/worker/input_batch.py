"""The worker's persistent batch: one state and one stable row per live request.

A request keeps its row (its ``slot``) from admission to its end or preemption, so the
per-row device tensors (``last_sampled``, the sampling state's penalty counts, bias rows
and bad-word history) are written once per sample and never moved.
"""

from __future__ import annotations

import torch

from forerun.core.output import NewRequestData, SchedulerOutput
from forerun.sampling_params import SamplingType
from forerun.worker import rng
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampling_state import SamplingState
from forerun.worker.spec_step import SpecDecodeStep


class InputBatch:
    """The requests the worker holds, their rows, and each row's last sample on the device.

    Worker-side substitution: after sampling, the ids stay in ``last_sampled`` (one stable
    row per request); when the next step schedules the position after a request's known
    ids, that row is scattered into the flat input on the device.
    """

    def __init__(self, max_num_seqs: int, device: torch.device,
                 sampling_state: SamplingState, spec: SpecDecodeStep | None) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        # Stable rows: preempted and finished requests give theirs back.
        self.max_num_reqs = max_num_seqs
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.sampling_state = sampling_state
        self.spec = spec  # with a drafter: it follows every request added and removed

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply a step's request changes: ends and preemptions, admissions, new blocks."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._release(state, req_id in so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self._release(old, False)
            self._add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            for table, new_ids in zip(state.block_ids, new_blocks, strict=True):
                table.extend(new_ids)
            if self.spec is None:
                state.num_computed_tokens = computed
            else:
                # The scheduler counted in-flight drafts as accepted; this side knows how
                # many were, and keeps its own count.
                assert computed >= state.num_computed_tokens, (req_id, computed, state)

    def _release(self, state: CachedRequestState, finished: bool) -> None:
        self._free_slots.append(state.slot)
        if self.spec is not None:
            self.spec.remove_request(state, finished)

    def _add_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        # A seeded request's uniforms depend on its seed and output index only, so a
        # resumed request continues its random stream exactly where it stopped.
        if params.seed is not None:
            key = rng.key_from_seed(params.seed)
        else:
            key = rng.random_key() if params.sampling_type == SamplingType.RANDOM else 0
        ids = new.prompt_token_ids
        num_prompt = new.num_prompt_tokens if new.num_prompt_tokens >= 0 else len(ids)
        state = CachedRequestState(
            req_id=new.req_id,
            token_ids=ids,
            block_ids=tuple(list(ids_of_group) for ids_of_group in new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling_params=params,
            rng_key=key,
            slot=self._free_slots.pop(),
            num_prompt_tokens=num_prompt,
            num_output_tokens=len(ids) - num_prompt,
            want_prompt_logprobs=new.want_prompt_logprobs,
            pooling_params=new.pooling_params,
        )
        self.requests[new.req_id] = state
        self.sampling_state.init_slot(state)
        if self.spec is not None:
            self.spec.add_request(state)
