"""The synchronous scheduler. Async-aware in the base, so the async subclass stays small."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from forerun.core.kv_cache_manager import KVCacheManager, cdiv
from forerun.core.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from forerun.core.stats import SchedulerCounters, SchedulerStats
from forerun.request import Request, RequestStatus
from forerun.structured.manager import GrammarEvent, Readiness

if TYPE_CHECKING:
    from forerun.kv_connector.base import KVConnectorBase, KVConnectorOutput
    from forerun.structured.bitmask import GrammarBitmask
    from forerun.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step and of the running set."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Park the blocks of a finished/preempted request until every step that may still
    # write them has been processed. On whenever more than one step can be in flight.
    defer_block_free: bool = False
    # Speculative decoding: the most drafts a request verifies per step (0 = off).
    num_speculative_tokens: int = 0
    # Pipeline stages: each step takes about 1/pp of the requests, so the stages work on
    # different requests at once (see Scheduler._pipeline_skips).
    pipeline_parallel_size: int = 1


class Scheduler:
    """Decides, step by step, how many tokens of which requests the model computes.

    One rule decides work: a request gets ``num_tokens_with_spec + num_output_placeholders
    - num_computed_tokens`` new tokens, clamped by the step's token budget (which is what
    makes prefill chunked). Pass 1 walks running requests; pass 2 admits waiting ones.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        structured_output_manager: StructuredOutputManager | None = None,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        # Compiles grammars, advances them with delivered tokens, builds step bitmasks.
        self.structured_output_manager = structured_output_manager
        # Requests finished outside a step (grammar failed to compile): reported with the
        # next update_from_output, which follows every schedule().
        self._outputs_without_step: list[EngineCoreOutput] = []
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        # One KV cache group (every model without sliding layers): the fast path, which
        # releases no block of a running request and sends a tuple of one block list.
        self._one_kv_group = not kv_cache_manager.releases_blocks_while_running
        self.max_model_len = config.max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        # The fence for deferred frees (kv_cache_manager.deferred_frees): non-empty steps
        # scheduled, and how many of them have had their output processed.
        self.defer_block_free = config.defer_block_free
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.counters = SchedulerCounters()
        self._next_step_id = 0
        # The KV connector's scheduler half (forerun/kv_connector/), or None: then none of
        # the state below is ever touched.
        self.connector = connector
        if connector is not None and kv_cache_manager.releases_blocks_while_running:
            raise ValueError("kv_transfer_config: KV connectors support one KV cache group "
                             "(no sliding-window layers) for now")
        # Requests in WAITING_FOR_REMOTE_KVS: the tokens they hold once loaded.
        self._load_target: dict[str, int] = {}
        # Blocks whose loads failed (reported before or with their request's finish).
        self._invalid_block_ids: set[int] = set()
        # Ended requests whose blocks a transfer still uses: freed when it reports.
        self._delayed_free: dict[str, Request] = {}

    # ----- requests in and out ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        # Its most blocks at once (a sliding-window group holds only its window's).
        need = self.kv_cache_manager.max_blocks_per_request(
            request.num_tokens + 1, self.config.max_num_batched_tokens)
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(
                f"prompt of {request.num_tokens} tokens needs {need} KV blocks but the cache "
                f"has only {self.kv_cache_manager.num_blocks}"
            )
        if request.use_structured_output:
            if self.structured_output_manager is None:
                raise ValueError("structured_outputs: this engine has no grammar backend")
            # Starts compiling; the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.
            self.structured_output_manager.add_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort). Their in-flight output will be discarded."""
        assert RequestStatus.is_finished(status)
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_requests(self) -> bool:
        """Work left: requests, or (with a connector) ended requests' transfers, which need
        steps to be started and reported."""
        return bool(self.running or self.waiting or self._delayed_free)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues and counters (the KV cache reports its own)."""
        grammar = (self.structured_output_manager.stats
                   if self.structured_output_manager is not None else None)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_reqs_deferred=sum(
                1 for r in self.waiting
                if r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                or r.num_stale_output_tokens > 0),
            num_waiting_reqs_for_remote_kvs=len(self._load_target),
            num_grammars_compiled=grammar.num_compiled if grammar else 0,
            num_grammar_compile_errors=grammar.num_compile_errors if grammar else 0,
            num_grammar_rejected_tokens=grammar.num_rejected_tokens if grammar else 0,
            **msgspec.to_builtins(self.counters),  # a copy: the snapshot shares no list with live counters
        )

    # ----- schedule ---------------------------------------------------------------------
    def _is_output_surely_done(self, request: Request) -> bool:
        """True when the steps in flight will already take the request to its end.

        The seed's check (``C + 2 - P >= prompt + max_tokens``) assumes one step in flight;
        counting promised tokens works at any depth.
        """
        if request.num_output_placeholders == 0:
            return False
        # Drafts in flight count as accepted. If some are rejected, the request is short of
        # its end and is scheduled again once that output arrives: a step of bubble for
        # it, where assuming rejection would risk a step of wasted work instead.
        promised = request.num_output_tokens + request.num_output_placeholders
        return (
            promised >= request.max_tokens
            or request.num_tokens_with_placeholders >= self.max_model_len
        )

    def _clamp_spec_tokens(self, request: Request) -> None:
        """Never draft past max_tokens or max_model_len, even if every draft in flight and
        every draft of this step is accepted (plus the one token the step samples)."""
        if request.num_spec_tokens == 0:
            return
        ahead = request.num_tokens_with_placeholders
        room = min(request.max_tokens - request.num_output_tokens
                   - request.num_output_placeholders, self.max_model_len - ahead) - 1
        request.num_spec_tokens = max(0, min(request.num_spec_tokens, room))

    def _pipeline_skips(self, request: Request) -> bool:
        """With pipeline stages, leave out a request whose last sample comes from one of the
        newest ``pp - 1`` steps: the first stage would have to wait for that sample, which
        the last stage has not produced yet. ``pp`` steps later it is there (with async
        scheduling still as a placeholder the first stage fills from the received output).
        """
        pp = self.config.pipeline_parallel_size
        return (pp > 1 and request.num_output_placeholders > 0
                and self.sched_step_seq + 1 - request.last_sched_seq < pp)

    def _max_reqs_per_step(self) -> int:
        """About 1/pp of the requests per step, so that pp steps in flight hold them all."""
        pp = self.config.pipeline_parallel_size
        if pp == 1:
            return self.config.max_num_seqs
        return max(1, cdiv(len(self.running) + len(self.waiting), pp))

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        max_reqs = self._max_reqs_per_step()
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, tuple[list[int], ...]] = {}
        spec_of: dict[str, int] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []

        # Pass 1: running requests, in order.
        req_index = 0
        while (req_index < len(self.running) and token_budget > 0
               and len(num_scheduled) < max_reqs):
            request = self.running[req_index]
            if self._is_output_surely_done(request) or self._pipeline_skips(request):
                req_index += 1
                continue
            self._clamp_spec_tokens(request)
            n = (request.num_tokens_with_placeholders + request.num_spec_tokens
                 - request.num_computed_tokens)
            n = min(n, token_budget, self.max_model_len - request.num_computed_tokens)
            if n <= 0:
                req_index += 1
                continue
            new_blocks = None
            while True:
                # The fence covers sliding-window blocks this step no longer sees (one
                # full-attention group releases none: no fence to compute).
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, n, fence_step_seq=None if self._one_kv_group
                    else self._free_fence(request))
                if new_blocks is not None:
                    break
                if self.kv_cache_manager.deferred_blocks_would_fit(request, n):
                    break  # wait for the fence to release parked blocks instead
                victim = self.running.pop()
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                if request.status == RequestStatus.PREEMPTED:
                    break
                req_index += 1
                continue
            scheduled_running.append(request)
            num_scheduled[request.request_id] = n
            if self._one_kv_group:
                new_blocks_of[request.request_id] = ([b.block_id for b in new_blocks],)
            else:
                new_blocks_of[request.request_id] = self.kv_cache_manager.block_ids_of(
                    new_blocks)
            # The tail of n beyond the known and promised tokens is drafts.
            num_spec = n + request.num_computed_tokens - request.num_tokens \
                - request.num_output_placeholders
            if num_spec > 0:
                spec_of[request.request_id] = num_spec
            # Consumed: the worker's drafter (sync) or the async hook sets the next count.
            request.num_spec_tokens = 0
            token_budget -= n
            req_index += 1

        # Pass 2: admit waiting requests, unless this step had to preempt.
        skipped: list[Request] = []
        compiling: list[Request] = []
        if not preempted:
            while (
                self.waiting
                and token_budget > 0
                and len(self.running) + len(self._load_target) < self.config.max_num_seqs
                and len(num_scheduled) < max_reqs
            ):
                request = self.waiting[0]
                if request.num_stale_output_tokens:
                    # Its stale output is still in flight: resuming now could re-sample a
                    # position that output will fill.
                    skipped.append(self.waiting.popleft())
                    continue
                if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                    if not self._try_promote_blocked(request):
                        self.waiting.popleft()
                        if request.is_finished():  # the hook gave up on it
                            self._free_request(request)
                        else:
                            skipped.append(request)
                            compiling.append(request)
                        continue
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    skipped.append(self.waiting.popleft())  # its blocks are being filled
                    continue
                if request.skips_prefix_cache:
                    # Cached positions would not be computed, and their logprobs (or their
                    # hidden states, for MEAN/CLS pooling) are needed.
                    hits, num_hit = [], 0
                else:
                    hits, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None and not request.skips_prefix_cache:
                    loading = self._admit_with_connector(request, hits, num_hit, token_budget)
                    if loading is None:
                        break
                    if loading:
                        skipped.append(self.waiting.popleft())
                        continue
                    num_hit = request.num_computed_tokens
                    n = min(request.num_tokens - num_hit, token_budget)
                else:
                    n = min(request.num_tokens - num_hit, token_budget)
                    remaining = request.num_tokens - num_hit - n
                    new_blocks = self.kv_cache_manager.allocate_slots(
                        request, n, num_hit, hits, num_reserved_tokens=remaining
                    )
                    if new_blocks is None:
                        break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
                scheduled_new.append(request)
                num_scheduled[request.request_id] = n
                token_budget -= n
        for request in reversed(skipped):
            self.waiting.appendleft(request)
        if compiling and not num_scheduled and not self.running:
            # Nothing to run but grammars to wait for: block briefly instead of spinning.
            assert self.structured_output_manager is not None
            self.structured_output_manager.wait_for_any(compiling, timeout_s=0.01)

        return self._build_output(scheduled_new, scheduled_running, num_scheduled,
                                  new_blocks_of, spec_of)

    def _admit_with_connector(self, request: Request, hits: list, num_hit: int,
                              token_budget: int) -> bool | None:
        """Allocate for a waiting request, asking the connector what it can supply past the
        device hit. None: no room (the pass stops). True: an asynchronous load started, the
        request waits in WAITING_FOR_REMOTE_KVS holding its blocks. False: it runs now, with
        ``num_computed_tokens`` the device hit plus any synchronously loaded tokens."""
        assert self.connector is not None
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        load_async = load_async and num_external > 0
        computed = num_hit + num_external
        n = 0 if load_async else min(request.num_tokens - computed, token_budget)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, n, computed, hits, num_reserved_tokens=request.num_tokens - computed - n,
            publish=not load_async)
        if new_blocks is None:
            return None
        # The connector reads the device hit from num_computed_tokens (vLLM's convention).
        request.num_computed_tokens = num_hit
        if num_external:
            self.connector.update_state_after_alloc(
                request, (self.kv_cache_manager.get_block_ids(request.request_id),),
                num_external)
        if not load_async:
            request.num_computed_tokens = computed
            return False
        self.kv_cache_manager.cache_blocks(request, num_hit)  # the hit's own frontier
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._load_target[request.request_id] = computed
        return True

    def _update_from_kv_xfer_finished(self, kv_out: KVConnectorOutput) -> None:
        """Apply the worker half's report: free what ended requests' transfers held, and
        make loaded requests ordinary waiting ones again."""
        assert self.connector is not None
        self.connector.update_connector_output(kv_out)
        self._invalid_block_ids |= kv_out.invalid_block_ids
        for req_id in kv_out.finished_sending | kv_out.finished_recving:
            ended = self._delayed_free.pop(req_id, None)
            if ended is not None:
                self._release_blocks(ended)
                continue
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._finish_load(request)

    def _finish_load(self, request: Request) -> None:
        """Publish the loaded blocks (up to the first that failed), then release them all
        into the device prefix cache: the request is admitted as a fresh one and finds them
        there. So no waiting request holds blocks that a running one might need."""
        kv = self.kv_cache_manager
        target = self._load_target.pop(request.request_id)
        blocks = kv.get_block_ids(request.request_id)
        loaded = target
        for i in range(request.num_computed_tokens // self.block_size,
                       target // self.block_size):
            if blocks[i] in self._invalid_block_ids:
                loaded = i * self.block_size
                break
        self._invalid_block_ids.difference_update(blocks)
        kv.cache_blocks(request, loaded)
        self._release_blocks(request)  # no step of this life touched them: freed now
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    def _try_promote_blocked(self, request: Request) -> bool:
        """True once the request's grammar is compiled; it then waits as usual.

        Never blocks while other requests run. A grammar that failed (or timed out)
        finishes the request with FINISHED_ERROR, reported with the next update.
        """
        manager = self.structured_output_manager
        if manager is None:
            return True
        readiness = manager.try_promote(request)
        if readiness == Readiness.READY:
            request.status = RequestStatus.WAITING
            return True
        if readiness == Readiness.FAILED:
            request.status = RequestStatus.FINISHED_ERROR
            self._outputs_without_step.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason="error"))
        return False

    def _build_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        num_scheduled: dict[str, int],
        new_blocks_of: dict[str, tuple[list[int], ...]],
        spec_of: dict[str, int],
    ) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        for request in scheduled_new:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_group_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    num_prompt_tokens=request.num_prompt_tokens,
                    want_prompt_logprobs=request.wants_prompt_logprobs,
                    pooling_params=request.pooling_params,
                )
            )
        for request in scheduled_running:
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks_of[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
        total = sum(num_scheduled.values())
        out = SchedulerOutput(
            step_id=self._next_step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
            scheduled_spec_decode_tokens=spec_of,
        )
        self._next_step_id += 1
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        # New sets: the output holds the old ones.
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        if total > 0:
            self.sched_step_seq += 1
            self.counters.steps += 1
            self.counters.num_scheduled_tokens += total
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            request.last_sched_seq = self.sched_step_seq
            # A step that stops short of the known end (plus promised tokens) samples nothing.
            request.is_prefill_chunk = (
                request.num_computed_tokens < request.num_tokens_with_placeholders)

    # ----- preemption and freeing ---------------------------------------------------------
    def _preempt_request(self, request: Request) -> None:
        self._release_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.is_prefill_chunk = False
        # Output of steps still in flight is stale: delivered, but it must not touch the
        # counters reset here. Assignment, not +=: in-flight already includes any old share.
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        # Its drafts live on the worker row that the preemption drops.
        request.num_spec_tokens = 0
        self.counters.num_preemptions += 1
        self.waiting.appendleft(request)
        self.preempted_req_ids.add(request.request_id)
        logger.debug("preempted %s", request.request_id)

    def _free_fence(self, request: Request) -> int | None:
        """The step before whose processing the request's blocks may not be reused."""
        if self.defer_block_free and request.last_sched_seq > self.processed_step_seq:
            # A step in flight may still write the blocks. Fence on the newest scheduled
            # step: conservative, and keeps the manager's fences in order.
            return self.sched_step_seq
        return None

    def _release_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request, self._free_fence(request))

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Free an ended request; the connector's kv_transfer_params for its output."""
        self._load_target.pop(request.request_id, None)
        delay, params = False, None
        if self.connector is not None:
            # A transfer (a save, a consumer's read) may still need the blocks; the
            # connector may start a save here.
            block_ids = (self.kv_cache_manager.get_block_ids(request.request_id),)
            delay, params = self.connector.request_finished(request, block_ids)
        if delay:
            self._delayed_free[request.request_id] = request
        else:
            self._release_blocks(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    # ----- outputs ----------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled ids. Called exactly once per step, in FIFO order."""
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1
            self.kv_cache_manager.free_deferred(self.processed_step_seq)
        if model_runner_output.kv_connector_output is not None and self.connector is not None:
            self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        outputs, self._outputs_without_step = self._outputs_without_step, []
        stopped_running: set[str] = set()
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                # Finished or aborted while this step ran: the work is thrown away.
                self.counters.wasted_tokens += n
                continue
            request.num_in_flight_tokens -= n
            is_stale = request.num_stale_output_tokens > 0
            if is_stale:
                request.num_stale_output_tokens -= n
            i = index.get(req_id)
            new_ids = sampled[i] if i is not None else []
            num_spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id, 0)
            if num_spec:
                self._reconcile_drafts(request, num_spec, len(new_ids), is_stale)
            self._record_spec_stats(req_id, new_ids, model_runner_output)
            status_before = request.status
            new_ids, stopped = self._update_request_with_output(
                request, new_ids, is_stale, status_before
            )
            pooled = model_runner_output.pooler_output.get(req_id)
            if pooled is not None and (is_stale or request.pooling_params is None):
                pooled = None  # a preempted life's vector: the request is recomputed
            if pooled is not None:
                # The step computed the prompt's last position: the request is done.
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            chunk = model_runner_output.prompt_logprobs.get(req_id)
            if chunk is not None and request.wants_prompt_logprobs:
                assert request.prompt_logprobs is not None
                request.prompt_logprobs[chunk.start: chunk.start + len(chunk.entries)] = \
                    chunk.entries
            logprobs = model_runner_output.logprobs.get(req_id)
            prompt_logprobs = None
            if new_ids and request.wants_prompt_logprobs:
                prompt_logprobs = request.prompt_logprobs
                request.prompt_logprobs_sent = True
            if not stopped and not is_stale and request.status == RequestStatus.RUNNING:
                self._set_next_spec_tokens(request, model_runner_output)
            kv_transfer_params = None
            if stopped:
                if status_before == RequestStatus.RUNNING:
                    stopped_running.add(req_id)
                else:
                    self.waiting.remove(request)
                kv_transfer_params = self._free_request(request)
            if new_ids or stopped:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_ids,
                        finish_reason=request.get_finished_reason() if stopped else None,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        # Trimmed like the ids when a stop cut them short.
                        logprobs=logprobs[: len(new_ids)] if logprobs is not None else None,
                        prompt_logprobs=prompt_logprobs,
                        pooling_output=pooled,
                        kv_transfer_params=kv_transfer_params,
                    )
                )
        if stopped_running:
            self.running = [r for r in self.running if r.request_id not in stopped_running]
        return outputs

    def _reconcile_drafts(self, request: Request, num_spec: int, num_sampled: int,
                          is_stale: bool) -> None:
        """Take back what the step's rejected drafts had advanced.

        The step was scheduled as if every draft would be accepted; ``num_sampled`` is the
        accepted drafts plus the one token sampled after them. Stale output belongs to a
        life the preemption already reset.
        """
        if is_stale:
            return
        rejected = num_spec - max(num_sampled - 1, 0)
        request.num_computed_tokens -= rejected
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= rejected

    def _record_spec_stats(self, req_id: str, new_ids: list[int],
                           out: ModelRunnerOutput) -> None:
        num_drafts = out.num_draft_tokens.get(req_id, 0)
        if num_drafts == 0:
            return
        c = self.counters
        accepted = len(new_ids) - 1
        c.spec_num_drafts += 1
        c.spec_num_draft_tokens += num_drafts
        c.spec_num_accepted_tokens += accepted
        per_pos = c.spec_num_accepted_tokens_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for pos in range(accepted):
            per_pos[pos] += 1

    def _set_next_spec_tokens(self, request: Request, out: ModelRunnerOutput) -> None:
        """With no step of the request in flight (always, in sync), the output says how many
        drafts the worker holds for its next step. With steps in flight, the async hook has
        already reserved the full count for the step after them, and this output is older."""
        if (self.config.num_speculative_tokens and request.spec_enabled
                and request.num_output_placeholders == 0):
            request.num_spec_tokens = out.num_next_draft_tokens.get(request.request_id, 0)

    def _update_request_with_output(
        self,
        request: Request,
        new_token_ids: list[int],
        is_stale: bool,
        status_before: RequestStatus,
    ) -> tuple[list[int], bool]:
        """Append ids one by one with the stop checks; trims ids after a stop."""
        params = request.sampling_params
        grammar = self.structured_output_manager if request.use_structured_output else None
        for i, token_id in enumerate(new_token_ids):
            if grammar is not None:
                event = grammar.accept_token(request, token_id)
                if event == GrammarEvent.REJECTED:
                    # Ends this request only; the token is not delivered.
                    request.status = RequestStatus.FINISHED_ERROR
                    return new_token_ids[:i], True
            request.append_output_token_ids([token_id])
            if self._check_stop(request, token_id, params.min_tokens):
                return new_token_ids[: i + 1], True
            if grammar is not None and event == GrammarEvent.TERMINATED:
                # The grammar accepted its stop token (possible with ignore_eos).
                request.status = RequestStatus.FINISHED_STOPPED
                return new_token_ids[: i + 1], True
            if grammar is not None and event == GrammarEvent.CLOSED:
                # The budget-aware ending completed the JSON: max_tokens ended the output.
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                return new_token_ids[: i + 1], True
        return new_token_ids, False

    def _check_stop(self, request: Request, token_id: int, min_tokens: int) -> bool:
        if request.num_output_tokens >= min_tokens:
            params = request.sampling_params
            if token_id in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                if token_id in (params.stop_token_ids or []):
                    request.stop_reason = token_id
                return True
        if (
            request.num_tokens >= self.max_model_len
            or request.num_output_tokens >= request.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """Token masks for this step's sampling grammar requests; None if there are none.

        Call only after every earlier step's output was applied (the engine defers
        sampling when ``pending_structured_output_tokens`` says that has not happened).
        """
        if self.structured_output_manager is None:
            return None
        return self.structured_output_manager.grammar_bitmask(scheduler_output, self.requests)
