"""Scheduler-side structured output: grammar readiness, token acceptance, step bitmasks."""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from forerun.structured.bitmask import GrammarBitmask
from forerun.structured.closing import (
    CLOSING_MARGIN,
    PLAN_STRIDE,
    ClosingState,
    is_allowed,
    only_token,
)
from forerun.structured.closing_text import TextClosingState
from forerun.structured.reasoning_gate import ReasoningGate
from forerun.structured_params import StructuredOutputsParams

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
    # The budget-aware ending completed the JSON: the request ends as length-capped.
    CLOSED = enum.auto()


@dataclass(slots=True)
class StructuredOutputRequest:
    """A request's compilation future and, once compiled, its matcher."""

    params: StructuredOutputsParams
    future: Future | None
    submitted_at: float
    grammar: StructuredGrammar | None = None
    error: str | None = None
    # The budget-aware ending's state (JSON; choice and regex in TextClosingState; none
    # for an EBNF grammar or with disable_budget_closing).
    closing: ClosingState | TextClosingState | None = None
    # With a reasoning_parser: the grammar waits until the reasoning ends.
    gate: ReasoningGate | None = None

    def num_answer_tokens(self, num_output_tokens: int) -> int:
        """How many of the output tokens the grammar has seen (those after the reasoning)."""
        if self.gate is None:
            return num_output_tokens
        done = self.gate.num_reasoning_tokens
        return 0 if done is None else num_output_tokens - done

    @property
    def grammar_applies(self) -> bool:
        """Whether the next token is the grammar's to mask (not while reasoning)."""
        return self.gate is None or self.gate.is_open


@dataclass(slots=True)
class StructuredOutputStats:
    """Counters for the engine's stats."""

    num_compiled: int = 0
    num_compile_errors: int = 0
    num_rejected_tokens: int = 0
    num_bitmasks: int = 0
    compile_time_s: float = 0.0
    # Requests whose masks the budget-aware ending narrowed, and those it completed.
    num_closing: int = 0
    num_closed: int = 0


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
            params, self.backend.compile_async(params), time.monotonic(),
            gate=None if params.after_reasoning is None
            else ReasoningGate.for_parser(params.after_reasoning))
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
        if so_req.gate is not None:
            so_req.gate.start(self._text(request.prompt_token_ids), request.num_output_tokens)
        params = so_req.params
        if params.budget_closing:
            if params.kind == "choice":
                so_req.closing = TextClosingState([c.encode() for c in params.choice or []])
            elif params.kind == "regex":
                so_req.closing = TextClosingState(None)
            else:
                so_req.closing = ClosingState()
        self.stats.num_compiled += 1
        self.stats.compile_time_s += time.monotonic() - so_req.submitted_at
        return Readiness.READY

    def _fail(self, request: Request, so_req: StructuredOutputRequest, why: str) -> Readiness:
        so_req.error = why
        so_req.future = None
        self.stats.num_compile_errors += 1
        logger.error("request %s: %s", request.request_id, why)
        return Readiness.FAILED

    def _text(self, token_ids: list[int]) -> str:
        """The tokens' text as the grammar's vocabulary spells it (markers are ASCII, so a
        character split across tokens, shown as U+FFFD, cannot hide one)."""
        token_bytes = self.backend.token_bytes()
        return b"".join(token_bytes[t] for t in token_ids
                        if 0 <= t < len(token_bytes)).decode("utf-8", "replace")

    def accept_token(self, request: Request, token_id: int) -> GrammarEvent:
        """Advance the request's matcher by one delivered token (call it before the token
        is appended to the request's output). While the request reasons the token goes to
        its gate instead, and the matcher stays where it is."""
        so_req: StructuredOutputRequest = request.structured_output_request
        grammar = so_req.grammar
        assert grammar is not None, f"{request.request_id} produced a token before its grammar"
        gate = so_req.gate
        if gate is not None and not gate.is_open:
            gate.feed(self._text([token_id]), request.num_output_tokens)
            return GrammarEvent.ACCEPTED
        if not grammar.accept_token(token_id):
            self.stats.num_rejected_tokens += 1
            logger.error("request %s: the grammar rejected token %d after %d tokens",
                         request.request_id, token_id, grammar.num_accepted)
            return GrammarEvent.REJECTED
        if grammar.is_terminated():
            return GrammarEvent.TERMINATED
        closing = so_req.closing
        if isinstance(closing, TextClosingState):
            # No early end: the narrowed masks leave the model its stop token (or
            # max_tokens its cut) on a whole answer.
            closing.accept(token_id, self.backend.closing_planner().token_bytes[token_id])
        elif closing is not None:
            closing.lexer.feed(self.backend.closing_planner().token_bytes[token_id])
            if closing.forced:
                assert closing.forced[0] == token_id, (request.request_id, token_id)
                closing.forced.popleft()
            if closing.active and grammar.matcher.is_completed():
                self.stats.num_closed += 1
                return GrammarEvent.CLOSED
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
            so_req: StructuredOutputRequest = request.structured_output_request
            if not so_req.grammar_applies:
                continue  # still reasoning: no mask
            grammar = so_req.grammar
            # The only unknown token may be the one this step samples.
            assert request.num_output_placeholders <= 1, request
            assert grammar.num_accepted == so_req.num_answer_tokens(
                request.num_output_tokens), (request, grammar.num_accepted)
            rows.append((req_id, grammar))
        if not rows:
            return None
        bitmask = self.backend.allocate_bitmask(len(rows))
        for i, (req_id, grammar) in enumerate(rows):
            grammar.fill_bitmask(bitmask, i)
            request = requests[req_id]
            closing = request.structured_output_request.closing
            if isinstance(closing, TextClosingState):
                self._end_text_within_budget(request, bitmask[i])
            elif closing is not None:
                self._close_within_budget(request, bitmask[i])
        self.stats.num_bitmasks += 1
        return GrammarBitmask([r for r, _ in rows], bitmask)

    def _close_within_budget(self, request: Request, row: torch.Tensor) -> None:
        """Narrow ``row`` (the grammar's mask) so that the JSON ends within max_tokens.

        ``left`` is the tokens still to sample, this step's included: every earlier step's
        output was applied, so the only token in flight is the one this mask is for (the
        same count in sync and async mode). Until the plan's length plus the margin reaches
        ``left`` the row stays the grammar's own.
        """
        so_req: StructuredOutputRequest = request.structured_output_request
        st = so_req.closing
        assert st is not None and so_req.grammar is not None
        if st.forced:  # following a plan to the end
            only_token(row, st.forced[0])
            return
        left = request.max_tokens - request.num_output_tokens
        done = request.num_output_tokens
        plan = st.plan
        near = plan is None or left <= 2 * (len(plan) + CLOSING_MARGIN) + 16
        if st.active or (near and st.planned_at != done) or done - st.planned_at >= PLAN_STRIDE:
            planner = self.backend.closing_planner()
            plan = st.plan = planner.plan(so_req.grammar.matcher, st.lexer)
            st.planned_at = done
        if not plan or left > len(plan) + CLOSING_MARGIN:
            return  # nothing to close, no plan found, or room enough: the grammar's row
        if not is_allowed(row, plan[0]):  # never expected: the plan was checked
            logger.warning("request %s: closing plan not allowed by its grammar",
                           request.request_id)
            return
        if not st.active:
            st.started_at = done
            self.stats.num_closing += 1
        if left - len(plan) >= 2:
            # Slack left: any token that starts the plan's text; the plan is redone after.
            row &= self.backend.closing_planner().closing_tokens(plan)[: row.shape[0]]
            return
        st.forced = deque(plan)
        only_token(row, plan[0])

    def _end_text_within_budget(self, request: Request, row: torch.Tensor) -> None:
        """Narrow ``row`` so that a choice or regex output ends inside its language within
        max_tokens (:mod:`forerun.structured.closing_text`).

        ``left`` counts as in :meth:`_close_within_budget` (the same in sync and async
        mode). The row stays the grammar's own until the completion bound comes within
        ``CLOSING_MARGIN`` of ``left`` (a choice: within its longest choice), and when no
        completion fits at all. A complete answer is narrowed too (to its stop token and
        the continuations that can complete again in time).
        """
        so_req: StructuredOutputRequest = request.structured_output_request
        st = so_req.closing
        assert isinstance(st, TextClosingState) and so_req.grammar is not None
        matcher = so_req.grammar.matcher
        left = request.max_tokens - request.num_output_tokens
        done = request.num_output_tokens
        planner = self.backend.text_closing_planner()
        plan = st.plan
        near = plan is None or left <= 2 * (len(plan) + CLOSING_MARGIN) + 16
        if st.active or st.choices is not None or (near and st.planned_at != done) \
                or done - st.planned_at >= PLAN_STRIDE:
            plan = st.plan = planner.bound(st, matcher)
            st.planned_at = done
        margin = planner.longest(st) if st.choices is not None else CLOSING_MARGIN
        if plan is None or left > len(plan) + margin or left < len(plan):
            st.carried = {}
            return  # room enough, no bound found, or no completion fits: the grammar's row
        if plan and not is_allowed(row, plan[0]):  # never expected: the bound was spelled on the vocab
            logger.warning("request %s: completion bound not allowed by its grammar",
                           request.request_id)
            st.carried = {}
            return
        if not st.active:
            st.started_at = done
            self.stats.num_closing += 1
        planner.narrow(st, matcher, row, plan, left, self.backend.vocab_size)

    def shutdown(self) -> None:
        self.backend.shutdown()
