"""Runs the model runner on one dedicated worker thread, one call at a time, in order."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.worker.model_runner import AsyncModelRunnerOutput, ModelRunner

logger = logging.getLogger(__name__)


class _ResolvedFuture(Future):
    """Resolves an async (device -> host) output on ``result()`` in the caller's thread."""

    def __init__(self, inner: Future) -> None:
        super().__init__()
        self._inner = inner

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:  # type: ignore[override]
        out = self._inner.result(timeout)
        return out.get_output() if isinstance(out, AsyncModelRunnerOutput) else out

    def done(self) -> bool:
        return self._inner.done()


class Executor:
    """Queues ``execute_model`` and ``sample_tokens`` onto the worker thread.

    Both return futures at once. A single worker thread is what orders every write to the
    KV cache, so a block freed by the scheduler can only be rewritten by a later step.
    """

    def __init__(self, runner_factory: Callable[[], ModelRunner]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forerun-worker")
        # Build the runner on its own thread, so thread-local state (streams) lives there.
        self.runner: ModelRunner = self._pool.submit(runner_factory).result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._pool.submit(self.runner.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        return _ResolvedFuture(self._pool.submit(self.runner.sample_tokens, grammar_bitmask))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
