"""The scheduler that runs one step ahead of reality."""

from __future__ import annotations

from forerun.core.output import SchedulerOutput
from forerun.core.scheduler import Scheduler
from forerun.request import Request, RequestStatus


class AsyncScheduler(Scheduler):
    """Schedules step N+1 while step N is still running, with output placeholders.

    Overrides exactly two hooks of :class:`Scheduler`. Everything else async-specific (the
    max_tokens guard, stale output after preemption, the deferred-free fence) lives in the
    base class and is a no-op while no placeholders exist.
    """

    num_sampled_tokens_per_step = 1

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        pending_structured = False
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = self.config.num_speculative_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            if request.is_prefill_chunk or request.pooling_params is not None:
                continue  # samples nothing: a chunk short of the end, or a pooling request
            # A grammar needs the token in flight before it can mask this step.
            pending_structured |= (
                request.use_structured_output and request.num_output_placeholders > 0
            )
            # A promise: the step just scheduled will produce this many tokens, whose
            # ids nobody on this side knows yet (its drafts count as if all accepted).
            request.num_output_placeholders += (
                self.num_sampled_tokens_per_step + spec.get(req_id, 0))
            if num_drafts and request.spec_enabled:
                # The drafter runs after this step samples, before the next step executes:
                # schedule the full count; the worker verifies what it has.
                request.num_spec_tokens = num_drafts
        scheduler_output.pending_structured_output_tokens |= pending_structured

    def _update_request_with_output(
        self,
        request: Request,
        new_token_ids: list[int],
        is_stale: bool,
        status_before: RequestStatus,
    ) -> tuple[list[int], bool]:
        new_token_ids, stopped = super()._update_request_with_output(
            request, new_token_ids, is_stale, status_before
        )
        # Placeholders were zeroed at preemption; a stale delivery must not redeem them.
        if not is_stale:
            request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0, request
        if status_before == RequestStatus.RUNNING:
            # Only positions with known ids and enqueued KV writes may be hashed.
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_output_placeholders
            )
        return new_token_ids, stopped
