"""The engine core loop: schedule, launch, and reconcile, with an optional batch queue."""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Protocol

from forerun.core.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from forerun.core.scheduler import Scheduler
from forerun.core.stats import EngineStats
from forerun.request import Request, RequestStatus
from forerun.trace import ENGINE_LANE, Tracer

logger = logging.getLogger(__name__)


class ExecutorLike(Protocol):
    """What the engine core needs from an executor: two queued calls returning futures."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]: ...

    def sample_tokens(self, grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]: ...


class EngineCore:
    """Drives a scheduler and an executor.

    With ``max_concurrent_batches == 1`` it runs :meth:`step`: schedule, run, update.
    With more, :meth:`step_with_batch_queue` keeps that many steps in flight: it schedules
    and launches step N+1 before it waits for step N's sampled ids.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ExecutorLike,
        max_concurrent_batches: int = 1,
        tracer: Tracer | None = None,
        async_scheduling: bool | None = None,
    ) -> None:
        if max_concurrent_batches < 1:
            raise ValueError("max_concurrent_batches must be at least 1")
        self.scheduler = scheduler
        self.executor = executor
        self.max_concurrent_batches = max_concurrent_batches
        self.tracer = tracer or Tracer()
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self.async_scheduling = (
            max_concurrent_batches > 1 if async_scheduling is None else async_scheduling)
        self._window_start = time.perf_counter()
        self._window_end: float | None = None
        # Steps whose sampling waited for the previous step's output (grammar requests).
        self.num_deferred_samplings = 0

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # ----- loops ------------------------------------------------------------------------
    def run_step(self) -> list[EngineCoreOutput]:
        if self.max_concurrent_batches == 1:
            return self.step()
        return self.step_with_batch_queue()

    def _schedule(self) -> SchedulerOutput:
        with self.tracer.span("schedule", ENGINE_LANE, self.scheduler.sched_step_seq + 1):
            return self.scheduler.schedule()

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        with self.tracer.span("update", ENGINE_LANE, so.step_id):
            return self.scheduler.update_from_output(so, out)

    def _sample(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        bitmask = self.scheduler.get_grammar_bitmask(so)
        return self.executor.sample_tokens(bitmask)

    def step(self) -> list[EngineCoreOutput]:
        """One synchronous step: nothing is scheduled while the device works."""
        if not self.scheduler.has_requests():
            return []
        so = self._schedule()
        self.executor.execute_model(so)
        result = self._sample(so).result()
        return self._update(so, result)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Keep up to ``max_concurrent_batches`` steps in flight.

        Schedule and launch a step; if the queue still has room, return at once so the
        next call can schedule again before anything finishes. Otherwise wait for the
        oldest step and apply its output. A step whose grammar requests still wait on a
        token in flight gets its forward launched now and its sampling after the oldest
        step's output has advanced the grammars.
        """
        deferred: SchedulerOutput | None = None
        if self.scheduler.has_requests():
            so = self._schedule()
            self.executor.execute_model(so)
            executed = so.total_num_scheduled_tokens > 0
            if not so.pending_structured_output_tokens or not executed:
                self.batch_queue.append((self._sample(so), so))
                if len(self.batch_queue) < self.max_concurrent_batches and executed:
                    return []
            else:
                deferred = so
        if deferred is not None:
            return self._sample_deferred(deferred)
        if not self.batch_queue:
            return []
        future, oldest = self.batch_queue.popleft()
        result = future.result()
        return self._update(oldest, result)

    def _sample_deferred(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Apply every step in flight, then sample ``so`` (whose forward already runs).

        A grammar's mask for ``so`` needs the tokens of all earlier steps; with a queue of
        depth 2 that is the one step still in flight. Its forward was launched before this
        wait, so only the sampling of ``so`` is late: the span shows that wait.
        """
        self.num_deferred_samplings += 1
        outputs: list[EngineCoreOutput] = []
        with self.tracer.span("deferred_sample_wait", ENGINE_LANE, so.step_id):
            while self.batch_queue:
                future, oldest = self.batch_queue.popleft()
                outputs.extend(self._update(oldest, future.result()))
            self.batch_queue.append((self._sample(so), so))
        return outputs

    # ----- stats ------------------------------------------------------------------------
    def reset_stats_window(self) -> None:
        """Start a new window for ``device_busy_fraction`` (e.g. one generate call)."""
        self.tracer.reset_window()
        self._window_start = time.perf_counter()
        self._window_end = None

    def close_stats_window(self) -> None:
        self._window_end = time.perf_counter()

    def stats(self) -> EngineStats:
        """A snapshot: the scheduler's and the KV cache's own stats plus the engine's."""
        wall = (self._window_end or time.perf_counter()) - self._window_start
        tracer = self.tracer
        return EngineStats(
            scheduler=self.scheduler.make_stats(),
            kv_cache=self.scheduler.kv_cache_manager.make_stats(),
            async_scheduling=self.async_scheduling,
            max_concurrent_batches=self.max_concurrent_batches,
            device_busy_fraction=tracer.device_busy_s / wall if wall > 0 else 0.0,
            worker_idle_ms_per_step=(
                1e3 * tracer.worker_idle_s / tracer.worker_step_gaps
                if tracer.worker_step_gaps else 0.0),
            num_deferred_samplings=self.num_deferred_samplings,
        )

    def shutdown(self) -> None:
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
