"""Speculative decoding in the scheduler, with the fake worker scripting drafts and acceptance.

The fake worker's tokens are a function of request id and position, so a lossless engine
delivers the same outputs with drafts as without them, whatever is accepted: the oracle is
the one of the plain property tests. The harness checks the invariants after every event,
including the draft ledger (drafts in flight, placeholders counting them as accepted) and
the fake worker checks that the scheduler's ``num_computed_tokens`` is ahead of its own by
exactly the rejected drafts whose output the scheduler has not applied yet.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fake_executor import hash_accept
from tests.harness import Harness, expected_output, make_request
from tests.test_scheduler_properties import (
    Workload,
    assert_lossless_prefixes,
    oracle,
    run,
    workloads,
)

ENGINES = [(False, 1), (True, 2), (True, 3)]
K = 3


def single(prompt_len: int, max_tokens: int, eos_at: int | None = None, **kw) -> Harness:
    h = Harness(async_scheduling=kw.pop("async_scheduling", True), depth=kw.pop("depth", 2),
                num_blocks=kw.pop("num_blocks", 64), block_size=4,
                eos_at={"r": eos_at} if eos_at else {}, **kw)
    h.add(make_request("r", list(range(10, 10 + prompt_len)), max_tokens, 4))
    h.run_until_idle()
    h.assert_all_released()
    assert (h.outputs["r"], h.finish_reason["r"]) == expected_output(
        "r", prompt_len, max_tokens, eos_at)
    return h


def always(n: int):
    return lambda req_id, position: n


def test_every_draft_accepted_gives_k_plus_one_tokens_per_step():
    for async_scheduling, depth in ENGINES:
        h = single(8, 40, num_speculative_tokens=K, drafts_found=always(K),
                   accept=lambda r, p, d: d, async_scheduling=async_scheduling, depth=depth)
        stats = h.scheduler.make_stats()
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
        assert stats.spec_acceptance_rate == 1.0
        # Prefill gives 1 token; every later step gives K + 1 (the last one fewer).
        assert stats.steps <= 1 + -(-39 // (K + 1)) + (depth - 1), stats
        # Every step accepts all it verified; near max_tokens a step verifies fewer.
        per_pos = stats.spec_num_accepted_tokens_per_pos
        assert len(per_pos) == K and per_pos[0] == stats.spec_num_drafts
        assert per_pos == sorted(per_pos, reverse=True) and per_pos[-1] >= per_pos[0] - 1


def test_no_draft_accepted_gives_one_token_per_step_and_no_wasted_work_in_sync():
    h = single(8, 20, num_speculative_tokens=K, drafts_found=always(K),
               accept=lambda r, p, d: 0, async_scheduling=False, depth=1)
    stats = h.scheduler.make_stats()
    assert stats.spec_num_accepted_tokens == 0 and stats.spec_num_draft_tokens > 0
    assert stats.steps == 20 and stats.wasted_tokens == 0


def test_drafts_the_drafter_did_not_find_are_rejected_without_being_verified():
    # Async scheduling reserves K drafts per step; the worker found only one.
    h = single(8, 30, num_speculative_tokens=K, drafts_found=always(1),
               accept=lambda r, p, d: d)
    stats = h.scheduler.make_stats()
    assert stats.spec_num_draft_tokens == stats.spec_num_drafts  # one verified per step
    assert stats.spec_num_accepted_tokens_per_pos == [stats.spec_num_drafts]


def test_max_tokens_around_k_is_never_exceeded_and_sync_wastes_nothing():
    for max_tokens in (1, 2, K, K + 1, 2 * K + 1):
        for async_scheduling, depth in ENGINES:
            for accept in (lambda r, p, d: d, lambda r, p, d: 0, hash_accept(1)):
                h = single(5, max_tokens, num_speculative_tokens=K, drafts_found=always(K),
                           accept=accept, async_scheduling=async_scheduling, depth=depth)
                if not async_scheduling:
                    assert h.scheduler.counters.wasted_tokens == 0


def test_eos_inside_an_accepted_run_truncates_it():
    for eos_at in (2, 3, 5):
        for async_scheduling, depth in ENGINES:
            single(6, 30, eos_at=eos_at, num_speculative_tokens=K, drafts_found=always(K),
                   accept=lambda r, p, d: d, async_scheduling=async_scheduling, depth=depth)


def test_a_request_preempted_between_its_draft_and_its_verification_resumes_cleanly():
    """vLLM #40768: drafts reserved for a request that the step then preempts and later
    re-admits must never reach the worker as input. Here the worker only ever verifies
    drafts it holds for the row, and a resumed row starts with none."""
    seen = 0
    for seed in range(12):
        w = Workload(
            reqs=tuple(_spec(i, seed) for i in range(4)), block_size=4, num_blocks=14,
            budget=32, max_num_seqs=4, defer_block_free=True, max_model_len=4096,
            enable_caching=bool(seed % 2))
        for async_scheduling, depth in ENGINES[1:]:
            h = run(w, async_scheduling, depth, K, always(K), hash_accept(seed))
            for r in w.reqs:
                assert (h.outputs[r.req_id], h.finish_reason[r.req_id]) == oracle(r, 4096)
            seen += sum(1 for _, stale in h.preemptions if stale > 1)
    # Stale output of more than one token in flight at a preemption means drafts were.
    assert seen > 0, "the workloads should preempt requests with drafts in flight"


def _spec(i: int, seed: int):
    from tests.test_scheduler_properties import ReqSpec
    return ReqSpec(f"q{i}", tuple(1000 * (i + 1) + j for j in range(9 + 3 * i)),
                   20 + seed % 5, None, i % 2, None)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_aborts=False), st.integers(1, 4), st.integers(0, 4), st.integers(0, 9))
def test_random_drafts_and_acceptance_deliver_the_oracle_in_every_engine(w, k, found, seed):
    def drafts_found(req_id: str, position: int) -> int:
        return (hash((seed, req_id, position, "found")) & 0xFF) % (found + 1)
    for async_scheduling, depth in ENGINES:
        h = run(w, async_scheduling, depth, k, drafts_found, hash_accept(seed))
        for r in w.reqs:
            assert (h.outputs[r.req_id], h.finish_reason[r.req_id]) == oracle(
                r, w.max_model_len), (depth, r)
        if not async_scheduling:
            assert h.scheduler.counters.wasted_tokens == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_aborts=True), st.integers(1, 4), st.integers(0, 9))
def test_with_aborts_spec_outputs_are_lossless_prefixes(w, k, seed):
    for async_scheduling, depth in ENGINES:
        h = run(w, async_scheduling, depth, k, always(k), hash_accept(seed))
        assert_lossless_prefixes(h, w, depth)
