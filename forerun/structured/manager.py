"""Scheduler-side structured output: grammar readiness, token acceptance, step bitmasks."""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forerun.structured.bitmask import GrammarBitmask
from forerun.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    # Not imported at run time: xgrammar is slow to import and only needed once a
    # grammar request arrives (the backend is built lazily by the engine builder).
    from forerun.core.output import SchedulerOutput
    from forerun.request import Request
    from forerun.structured.backend import StructuredGrammar, XgrammarBackend

logger = logging.getLogger(__name__)


class Readiness(enum.Enum):
    """Where a request waiting for its grammar stands."""

    READY = enum.auto()
    PENDING = enum.auto()
    FAILED = enum.auto()


class GrammarEvent(enum.Enum):
    """What accepting one delivered token did to the grammar."""

    ACCEPTED = enum.auto()
    REJECTED = enum.auto()
    TERMINATED = enum.auto()


@dataclass(slots=True)
class StructuredOutputRequest:
    """A request's compilation future and, once compiled, its matcher."""

    params: StructuredOutputsParams
    future: Future | None
    submitted_at: float
    grammar: StructuredGrammar | None = None
    error: str | None = None


@dataclass(slots=True)
class StructuredOutputStats:
    """Counters for the engine's stats."""

    num_compiled: int = 0
    num_compile_errors: int = 0
    num_rejected_tokens: int = 0
    num_bitmasks: int = 0
    compile_time_s: float = 0.0


@dataclass(slots=True)
class StructuredOutputManager:
    """Owns the backend and every grammar request's state, on the scheduler's side.

    A grammar request waits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` while its grammar
    compiles on the backend's thread; the scheduler asks :meth:`try_promote` each time the
    request reaches the head of the waiting queue and skips it (without blocking others)
    until it is ready, or finishes it with an error once ``compile_timeout_s`` passed.
    """

    backend: XgrammarBackend
    compile_timeout_s: float = 30.0
    stats: StructuredOutputStats = field(default_factory=StructuredOutputStats)

    def add_request(self, request: Request) -> None:
        from forerun.request import RequestStatus

        params = StructuredOutputsParams.from_any(request.sampling_params.structured_outputs)
        request.structured_output_request = StructuredOutputRequest(
            params, self.backend.compile_async(params), time.monotonic())
        request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR

    def wait_for_any(self, requests: list[Request], timeout_s: float) -> None:
        """Block up to ``timeout_s`` for one of these requests' grammars to finish."""
        futures = [r.structured_output_request.future for r in requests]
        pending = [f for f in futures if f is not None]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def try_promote(self, request: Request, wait_s: float = 0.0) -> Readiness:
        """READY once compiled (the matcher is made here), FAILED on error or timeout."""
        so_req: StructuredOutputRequest = request.structured_output_request
        if so_req.grammar is not None:
            return Readiness.READY
        future = so_req.future
        assert future is not None
        if not future.done():
            # Only waits when the caller has nothing else to run: no busy spin on an
            # empty engine, and no stall of other requests.
            left = so_req.submitted_at + self.compile_timeout_s - time.monotonic()
            if left <= 0:
                future.cancel()
                return self._fail(request, so_req, (
                    f"grammar compilation took longer than {self.compile_timeout_s:g}s"))
            try:
                future.result(timeout=min(wait_s, left))
            except FutureTimeout:
                return Readiness.PENDING
            except Exception:
                pass  # reported below
            if not future.done():
                return Readiness.PENDING
        exc = future.exception()
        if exc is not None:
            return self._fail(request, so_req, f"grammar compilation failed: {exc}")
        so_req.grammar = self.backend.new_grammar(future.result())
        so_req.future = None
        self.stats.num_compiled += 1
        self.stats.compile_time_s += time.monotonic() - so_req.submitted_at
        return Readiness.READY

    def _fail(self, request: Request, so_req: StructuredOutputRequest, why: str) -> Readiness:
        so_req.error = why
        so_req.future = None
        self.stats.num_compile_errors += 1
        logger.error("request %s: %s", request.request_id, why)
        return Readiness.FAILED

    def accept_token(self, request: Request, token_id: int) -> GrammarEvent:
        """Advance the request's matcher by one delivered token."""
        so_req: StructuredOutputRequest = request.structured_output_request
        grammar = so_req.grammar
        assert grammar is not None, f"{request.request_id} produced a token before its grammar"
        if not grammar.accept_token(token_id):
            self.stats.num_rejected_tokens += 1
            logger.error("request %s: the grammar rejected token %d after %d tokens",
                         request.request_id, token_id, grammar.num_accepted)
            return GrammarEvent.REJECTED
        if grammar.is_terminated():
            return GrammarEvent.TERMINATED
        return GrammarEvent.ACCEPTED

    def grammar_bitmask(self, scheduler_output: SchedulerOutput,
                        requests: dict[str, Request]) -> GrammarBitmask | None:
        """Masks for the grammar requests that sample in this step, or None if none do.

        Must run after every earlier step's output was applied: each matcher then holds the
        state after the last token before the position this step samples.
        """
        rows: list[tuple[str, StructuredGrammar]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if (request is None or request.is_finished() or not request.use_structured_output
                    or request.is_prefill_chunk):
                continue
            grammar = request.structured_output_request.grammar
            # The only unknown token may be the one this step samples.
            assert request.num_output_placeholders <= 1, request
            assert grammar.num_accepted == request.num_output_tokens, (
                request, grammar.num_accepted)
            rows.append((req_id, grammar))
        if not rows:
            return None
        bitmask = self.backend.allocate_bitmask(len(rows))
        for i, (_, grammar) in enumerate(rows):
            grammar.fill_bitmask(bitmask, i)
        self.stats.num_bitmasks += 1
        return GrammarBitmask([r for r, _ in rows], bitmask)

    def shutdown(self) -> None:
        self.backend.shutdown()
