"""Property tests: random workloads through the sync and async engines with the fake worker.

Every run goes through :class:`tests.harness.Harness`, which checks the scheduler's
invariants after every schedule and every update event (placeholders never negative, the
confirmed frontier ``C - P == T - 1``, in-flight and stale counters against an independent
ledger, block ownership and reference counts, the prefix-cache frontier, free + held +
deferred == total). The outputs are compared with an oracle computed from the workload
alone (the fake worker's tokens are a function of request id and position), and between
the sync engine and the async engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun.core.kv_cache_manager import cdiv
from tests.harness import Harness, expected_output, make_request

SHARED_BASE = [7000 + j for j in range(60)]


@dataclass(frozen=True)
class ReqSpec:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    eos_at: int | None
    arrival: int
    abort_at: int | None


@dataclass(frozen=True)
class Workload:
    reqs: tuple[ReqSpec, ...]
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    defer_block_free: bool
    max_model_len: int
    enable_caching: bool

    @property
    def has_aborts(self) -> bool:
        return any(r.abort_at is not None for r in self.reqs)


@st.composite
def workloads(draw: st.DrawFn, with_aborts: bool) -> Workload:
    block_size = draw(st.sampled_from([4, 16]))
    n = draw(st.integers(1, 6))
    reqs = []
    for i in range(n):
        plen = draw(st.integers(1, 60))
        # Some prompts share a prefix, so prefix-cache hits and shared blocks happen.
        if draw(st.booleans()):
            prompt = tuple(SHARED_BASE[:plen])
        else:
            prompt = tuple(10_000 * (i + 1) + j for j in range(plen))
        max_tokens = draw(st.integers(1, 20))
        eos_at = draw(st.none() | st.integers(1, 20))
        arrival = draw(st.integers(0, 8))
        abort_at = None
        if with_aborts and draw(st.booleans()):
            abort_at = arrival + draw(st.integers(0, 25))
        reqs.append(ReqSpec(f"q{i}", prompt, max_tokens, eos_at, arrival, abort_at))
    # Tiny pools: the largest request just fits alone, so concurrency forces preemption.
    need = max(cdiv(len(r.prompt) + r.max_tokens, block_size) for r in reqs)
    num_blocks = need + draw(st.integers(0, need))
    return Workload(
        reqs=tuple(reqs),
        block_size=block_size,
        num_blocks=num_blocks,
        budget=draw(st.integers(4, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        defer_block_free=draw(st.booleans()),
        # Either out of reach or short enough (prompts are at most 60) to cut outputs.
        max_model_len=draw(st.sampled_from([4096]) | st.integers(61, 80)),
        enable_caching=draw(st.booleans()),
    )


def run(w: Workload, async_scheduling: bool, depth: int, num_speculative_tokens: int = 0,
        drafts_found: Callable[[str, int], int] | None = None,
        accept: Callable[[str, int, int], int] | None = None,
        pipeline_parallel_size: int = 1) -> Harness:
    """Drive the workload to the end (with the fake worker's drafts and acceptance, if
    spec decoding is on); checks every block is released."""
    h = Harness(
        async_scheduling=async_scheduling,
        depth=depth,
        num_blocks=w.num_blocks,
        block_size=w.block_size,
        max_num_batched_tokens=w.budget,
        max_num_seqs=w.max_num_seqs,
        max_model_len=w.max_model_len,
        enable_caching=w.enable_caching,
        defer_block_free=w.defer_block_free if depth > 1 else False,
        eos_at={r.req_id: r.eos_at for r in w.reqs if r.eos_at is not None},
        num_speculative_tokens=num_speculative_tokens, drafts_found=drafts_found,
        accept=accept, pipeline_parallel_size=pipeline_parallel_size,
    )
    last_event = max(max(r.arrival, r.abort_at or 0) for r in w.reqs)
    call = 0
    while call <= last_event or h.engine.has_work():
        for r in w.reqs:
            if r.arrival == call:
                h.add(make_request(r.req_id, list(r.prompt), r.max_tokens, w.block_size))
        for r in w.reqs:
            if r.abort_at == call:
                h.abort(r.req_id)
        h.step()
        call += 1
        assert call < 5_000, "engine made no progress"
    h.assert_all_released()
    return h


def oracle(r: ReqSpec, max_model_len: int) -> tuple[list[int], str]:
    # The sequence may not outgrow max_model_len: a length cap like max_tokens.
    cap = min(r.max_tokens, max_model_len - len(r.prompt))
    return expected_output(r.req_id, len(r.prompt), cap, r.eos_at)


def assert_lossless_prefixes(h: Harness, w: Workload, label: object) -> None:
    """Every request got the oracle's output, or (aborted) a prefix of it."""
    for r in w.reqs:
        full, reason = oracle(r, w.max_model_len)
        got, got_reason = h.outputs[r.req_id], h.finish_reason[r.req_id]
        if got_reason == "abort":
            assert r.abort_at is not None
            assert got == full[: len(got)], (label, r, got)
        else:
            assert (got, got_reason) == (full, reason), (label, r)


ENGINES = [(False, 1), (True, 2), (True, 3)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_aborts=False))
def test_without_aborts_every_engine_delivers_the_oracle_outputs(w: Workload):
    results = {}
    for async_scheduling, depth in ENGINES:
        h = run(w, async_scheduling, depth)
        results[depth] = {r.req_id: (h.outputs[r.req_id], h.finish_reason[r.req_id])
                          for r in w.reqs}
        for r in w.reqs:
            assert results[depth][r.req_id] == oracle(r, w.max_model_len), (depth, r)
        if not async_scheduling:
            assert h.scheduler.counters.wasted_tokens == 0
    assert results[2] == results[1] and results[3] == results[1]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_aborts=True))
def test_with_aborts_outputs_are_lossless_prefixes(w: Workload):
    for async_scheduling, depth in ENGINES:
        assert_lossless_prefixes(run(w, async_scheduling, depth), w, depth)
