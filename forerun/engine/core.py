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


class _StepFuture(Future):
    """A step's sampled output that raises the forward's own error if the forward failed.

    The worker's ``sample_tokens`` after a failed ``execute_model`` fails too, but with an
    assertion that hides the cause. The forward ran first (one worker thread, FIFO), so
    asking its future first costs no wait.
    """

    def __init__(self, execute: Future[None], sample: Future[ModelRunnerOutput]) -> None:
        super().__init__()
        self._execute = execute
        self._sample = sample

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:  # type: ignore[override]
        self._execute.result(timeout)
        return self._sample.result(timeout)

    def done(self) -> bool:
        return self._sample.done()


class EngineCore:
    """Drives a scheduler and an executor.

    With ``max_concurrent_batches == 1`` it runs :meth:`step`: schedule, run, update.
    With more, :meth:`step_with_batch_queue` keeps that many steps in flight: it schedules
    and launches step N+1 before it waits for step N's sampled ids.

    Every step the scheduler makes is run by the executor (``execute_model`` then
    ``sample_tokens``) and applied by ``update_from_output`` exactly once, in order, even
    when an exception (a KeyboardInterrupt too) interrupts :meth:`run_step`: see
    :meth:`_recover`.
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
        # The step being launched: scheduled, not yet in batch_queue with its sampling.
        # With its execute_model future once that call is queued.
        self._launching: SchedulerOutput | None = None
        self._launch_execute: Future[None] | None = None
        # Outputs of steps that _recover applied; the next run_step returns them.
        self._recovered: list[EngineCoreOutput] = []

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue) or bool(self._recovered)

    # ----- loops ------------------------------------------------------------------------
    def run_step(self) -> list[EngineCoreOutput]:
        """One step. If it raises, the steps in flight are retired first (:meth:`_recover`),
        so the engine stays usable and no block is lost."""
        if self._recovered:
            outputs, self._recovered = self._recovered, []
            return outputs
        try:
            if self.max_concurrent_batches == 1:
                return self.step()
            return self.step_with_batch_queue()
        except BaseException:
            self._recover()
            raise

    def _schedule(self) -> SchedulerOutput:
        with self.tracer.span("schedule", ENGINE_LANE, self.scheduler.sched_step_seq + 1):
            self._launching = self.scheduler.schedule()
            return self._launching

    def _execute(self, so: SchedulerOutput) -> None:
        self._launch_execute = self.executor.execute_model(so)

    def _enqueue(self, so: SchedulerOutput) -> None:
        """Queue the sampling of the step being launched; the step is then in flight."""
        assert self._launching is so and self._launch_execute is not None
        sample = _StepFuture(self._launch_execute, self._sample(so))
        self.batch_queue.append((sample, so))
        self._launching = self._launch_execute = None

    def _retire_oldest(self) -> list[EngineCoreOutput]:
        # Popped only once its output is here: a step interrupted while waiting stays
        # queued for _recover.
        future, oldest = self.batch_queue[0]
        result = future.result()
        self.batch_queue.popleft()
        return self._update(oldest, result)

    def _recover(self) -> None:
        """Bring executor and scheduler back in step after an exception inside a step.

        A scheduled step must reach the worker (it carries new and finished requests), each
        ``execute_model`` must be followed by its ``sample_tokens``, and each step's output
        must be applied once, or its requests' blocks are never freed. So: finish launching
        the step that was interrupted (without a grammar mask: a grammar request then fails
        on a rejected token rather than waiting for a mask that needs older outputs), wait
        for every step in flight, and apply them in order. A step the worker failed is
        applied as empty after its requests are finished with an error. Outputs are kept
        for the next :meth:`run_step`.
        """
        so, execute = self._launching, self._launch_execute
        self._launching = self._launch_execute = None
        if so is not None:
            try:
                if execute is None:
                    execute = self.executor.execute_model(so)
                future: Future[ModelRunnerOutput] = _StepFuture(
                    execute, self.executor.sample_tokens(None))
            except BaseException as exc:
                future = Future()
                future.set_exception(exc)
            self.batch_queue.append((future, so))
        while self.batch_queue:
            future, oldest = self.batch_queue[0]
            try:
                result = future.result()
            except BaseException as exc:
                logger.warning("step %d failed on the worker (%s: %s); its requests end with "
                               "an error", oldest.step_id, type(exc).__name__, exc)
                ids = [r for r in oldest.num_scheduled_tokens if r in self.scheduler.requests]
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
                self._recovered.extend(EngineCoreOutput(r, [], "error") for r in ids)
                result = ModelRunnerOutput([], {}, [])
            self.batch_queue.popleft()
            self._recovered.extend(self._update(oldest, result))

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
        self._execute(so)
        self._enqueue(so)
        return self._retire_oldest()

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
            self._execute(so)
            executed = so.total_num_scheduled_tokens > 0
            if not so.pending_structured_output_tokens or not executed:
                self._enqueue(so)
                if len(self.batch_queue) < self.max_concurrent_batches and executed:
                    return []
            else:
                deferred = so
        if deferred is not None:
            return self._sample_deferred(deferred)
        if not self.batch_queue:
            return []
        return self._retire_oldest()

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
                outputs.extend(self._retire_oldest())
            self._enqueue(so)
        return outputs

    # ----- stats ------------------------------------------------------------------------
    def reset_stats_window(self) -> None:
        """Start a new window for ``device_busy_fraction`` (e.g. one generate call)."""
        self.tracer.reset_window()
        self._window_start = time.perf_counter()
        self._window_end = None

    def close_stats_window(self) -> None:
        self._window_end = time.perf_counter()

    def stats(self, span_window_s: float = 0.0) -> EngineStats:
        """A snapshot: the scheduler's and the KV cache's own stats plus the engine's, with
        the step spans of the last ``span_window_s`` seconds."""
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
            weight_bytes=getattr(getattr(getattr(self.executor, "runner", None), "model", None),
                                 "resident_weight_bytes", 0),
            recent_spans=tracer.recent_spans(span_window_s),
        )

    def shutdown(self) -> None:
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
