"""Runs the model runner on one dedicated worker thread, one call at a time, in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.worker.cpu_threads import CallerThreadsGuard
from forerun.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One worker thread per process, shared by every engine in it: each OS thread that runs
# parallel torch ops gets an OpenMP team of its own, and two teams on this 2-core machine
# make every parallel region of both slower (see forerun/worker/cpu_threads.py). A second
# LLM in the same process (a benchmark comparing modes, a test) therefore queues its steps
# on the same thread instead of bringing a second team.
_worker_lock = threading.Lock()
_worker_pool: ThreadPoolExecutor | None = None


def worker_thread() -> ThreadPoolExecutor:
    """The process's model worker thread (created on first use, lives as long as the process)."""
    global _worker_pool
    with _worker_lock:
        if _worker_pool is None:
            _worker_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forerun-worker")
        return _worker_pool


def run_on_worker_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on the worker thread and wait: for torch work outside the engine (a
    reference model in a benchmark) that should not bring a second OpenMP team."""
    return worker_thread().submit(fn, *args, **kwargs).result()


class _ResolvedFuture(Future):
    """Resolves a deferred output (device -> host copy, or the last pipeline stage's) on
    ``result()`` in the caller's thread."""

    def __init__(self, inner: Future) -> None:
        super().__init__()
        self._inner = inner

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:  # type: ignore[override]
        out = self._inner.result(timeout)
        return out if isinstance(out, ModelRunnerOutput) else out.get_output()

    def done(self) -> bool:
        if not self._inner.done():
            return False
        if self._inner.exception() is not None:
            return True
        out = self._inner.result()
        return isinstance(out, ModelRunnerOutput) or getattr(out, "done", lambda: True)()


class Executor:
    """Queues ``execute_model`` and ``sample_tokens`` onto the worker thread.

    Both return futures at once. A single worker thread is what orders every write to the
    KV cache, so a block freed by the scheduler can only be rewritten by a later step.
    """

    def __init__(self, runner_factory: Callable[[], ModelRunner]) -> None:
        # The model's parallel torch ops run on the worker; the calling (engine) thread's
        # own ops are small and run inline, so that the process has one OpenMP team.
        self._threads_guard = CallerThreadsGuard()
        self._pool = worker_thread()
        self._closed = False
        # Build the runner on its own thread, so thread-local state (streams) lives there.
        self.runner: ModelRunner = self._pool.submit(runner_factory).result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._pool.submit(self.runner.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        return _ResolvedFuture(self._pool.submit(self.runner.sample_tokens, grammar_bitmask))

    def shutdown(self) -> None:
        """Wait for this executor's queued calls; the shared thread itself stays."""
        if self._closed:
            return
        self._closed = True
        self._pool.submit(lambda: None).result()  # FIFO: everything queued before is done
        connector = getattr(self.runner, "kv_connector", None)
        if connector is not None:
            connector.shutdown()  # its queued saves finish writing to disk
        self._threads_guard.restore()
