"""The KV connector under the fence: loads, saves, evictions, preemptions and aborts
interleaved with steps in flight (depths 1-3), with the invariants after every event.

The scheduler half is the real offloading connector's; the worker half is a fake whose
transfers finish a scripted number of steps later and whose loads sometimes find a stored
block gone. On top of the harness's invariants (tests/harness.py) every event checks that a
load writes only blocks its request holds alone and that no step in flight touches, that
every transfer's blocks stay held until it reports, and at the end that every block is free.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun.core.kv_cache_manager import cdiv
from forerun.request import RequestStatus
from tests.harness import Harness, expected_output, make_request
from tests.test_scheduler_properties import ENGINES, ReqSpec, Workload, assert_lossless_prefixes

BASES = [[3000 * (k + 1) + j for j in range(40)] for k in range(4)]


@st.composite
def offload_workloads(draw: st.DrawFn) -> Workload:
    """Conversations that come back: prompts are a shared base (cut anywhere) plus a short
    tail, arriving spread out through a pool that holds about one or two of them, so a
    prefix is often evicted before it is asked for again; some requests are aborted."""
    bs = 4
    reqs = []
    for i in range(draw(st.integers(3, 8))):
        base = BASES[draw(st.integers(0, len(BASES) - 1))]
        cut = draw(st.integers(8, len(base)))
        tail = [90_000 + 100 * i + j for j in range(draw(st.integers(0, 6)))]
        arrival = draw(st.integers(0, 60))
        abort_at = arrival + draw(st.integers(0, 12)) if draw(st.booleans()) else None
        reqs.append(ReqSpec(f"q{i}", tuple(base[:cut] + tail), draw(st.integers(1, 8)),
                            draw(st.none() | st.integers(1, 8)), arrival, abort_at))
    need = max(cdiv(len(r.prompt) + r.max_tokens, bs) for r in reqs)
    return Workload(reqs=tuple(reqs), block_size=bs, num_blocks=need + draw(st.integers(0, 6)),
                    budget=draw(st.integers(4, 48)), max_num_seqs=draw(st.integers(1, 4)),
                    defer_block_free=True, max_model_len=4096, enable_caching=True)


def run(w: Workload, async_scheduling: bool, depth: int, seed: int, lose_mod: int) -> Harness:
    h = Harness(
        async_scheduling=async_scheduling, depth=depth, num_blocks=w.num_blocks,
        block_size=w.block_size, max_num_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
        max_model_len=w.max_model_len, enable_caching=True,
        defer_block_free=depth > 1,
        eos_at={r.req_id: r.eos_at for r in w.reqs if r.eos_at is not None},
        connector_seed=seed,
        lose_block=(lambda b: b[0] % lose_mod == 0) if lose_mod else None,
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


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offload_workloads(), st.integers(0, 3), st.sampled_from([0, 0, 3]))
def test_transfers_interleaved_with_steps_in_flight_keep_every_invariant(w, seed, lose_mod):
    for async_scheduling, depth in ENGINES:
        assert_lossless_prefixes(run(w, async_scheduling, depth, seed, lose_mod), w, depth)


def _evicting_workload(h: Harness, prompt: list[int]) -> None:
    """Run ``prompt``, then enough other prompts to evict its blocks, then ``prompt`` again
    (as a new request), with transfers in flight throughout."""
    bs = h.block_size
    h.add(make_request("a", prompt, 3, bs))
    h.run_until_idle()
    for i in range(3):
        other = [50_000 + 1000 * i + j for j in range(len(prompt))]
        h.add(make_request(f"x{i}", other, 3, bs))
    h.run_until_idle()
    seen_waiting = []

    def note(so: object) -> None:
        r = h.scheduler.requests.get("b")
        if r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            seen_waiting.append(so)

    h.on_schedule.append(note)
    h.add(make_request("b", prompt, 3, bs))
    h.run_until_idle()
    assert seen_waiting, "the second run of the prompt never waited for its load"
    h.assert_all_released()


def test_evicted_prefix_comes_back_from_the_store_at_every_depth():
    prompt = list(range(10, 50))  # 10 blocks of 4, the pool holds 12
    for async_scheduling, depth in ENGINES:
        h = Harness(async_scheduling=async_scheduling, depth=depth, num_blocks=12,
                    block_size=4, max_num_seqs=1, connector_seed=depth)
        _evicting_workload(h, prompt)
        assert h.fake_connector is not None and h.fake_connector.num_loads == 1, depth
        assert (h.outputs["b"], h.finish_reason["b"]) == expected_output("b", 40, 3, None), depth
        # The load supplied every full block but the one holding the last prompt token.
        assert h.scheduler.connector.scheduler.num_loaded_tokens == 36, depth


def test_a_lost_block_ends_the_loaded_prefix_and_the_rest_is_recomputed():
    prompt = list(range(10, 50))
    h = Harness(async_scheduling=True, depth=2, num_blocks=12, block_size=4, max_num_seqs=1,
                connector_seed=1)
    lost: list[bytes] = []

    def lose(block_hash: bytes) -> bool:  # the fifth block of the prompt's chain
        if not lost and block_hash == h.scheduler.requests["b"].block_hashes[4]:
            lost.append(block_hash)
            return True
        return False

    assert h.fake_connector is not None
    h.fake_connector.lose = lose
    _evicting_workload(h, prompt)
    assert lost and h.fake_connector.num_lost == 1
    assert (h.outputs["b"], h.finish_reason["b"]) == expected_output("b", 40, 3, None)
