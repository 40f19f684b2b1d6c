"""Typed engine stats: built from the scheduler's and the KV manager's parts, and they
cross the process boundary as they are."""

from __future__ import annotations

from forerun.core.stats import EngineStats
from forerun.engine.core_messages import StatsReply, output_decoder, output_encoder
from tests.harness import Harness, make_request

BS = 4


def test_stats_parts_count_what_happened_and_survive_the_wire():
    h = Harness(async_scheduling=True, depth=2, num_blocks=16, block_size=BS,
                eos_at={"b": 2})
    h.add(make_request("a", list(range(8)), 4, BS))
    h.add(make_request("b", list(range(8)) + [99], 6, BS))
    h.step()
    mid = h.engine.stats()
    assert (mid.scheduler.num_running_reqs, mid.scheduler.num_waiting_reqs) == (2, 0)
    assert mid.kv_cache.num_free_blocks < mid.kv_cache.num_blocks == 16
    assert mid.kv_cache.usage == 1 - mid.kv_cache.num_free_blocks / 16
    h.run_until_idle()
    h.assert_all_released()

    stats = h.engine.stats()
    sched, kv = stats.scheduler, stats.kv_cache
    assert sched.num_running_reqs == sched.num_waiting_reqs == 0
    # b ends on EOS with one step in flight behind it: that step's token is wasted.
    assert sched.wasted_tokens == 1 == h.scheduler.counters.wasted_tokens
    assert sched.steps == h.scheduler.counters.steps > 0
    assert sched.num_grammars_compiled == 0  # no grammar backend in the harness
    assert (kv.num_free_blocks, kv.num_deferred_blocks, kv.usage) == (16, 0, 0.0)
    # b's first two blocks were found under a's hashes.
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 8 + 9
    assert kv.prefix_cache_hit_rate == 8 / 17
    assert stats.async_scheduling is True and stats.max_concurrent_batches == 2

    reply = output_decoder.decode(output_encoder.encode(StatsReply(7, stats)))
    assert isinstance(reply, StatsReply) and reply.call_id == 7
    assert isinstance(reply.stats, EngineStats) and reply.stats == stats
    as_dict = stats.to_dict()
    assert as_dict["scheduler"]["wasted_tokens"] == 1
    assert as_dict["kv_cache"]["num_blocks"] == 16


def test_waiting_requests_are_split_by_reason():
    # max_num_seqs=1: the second request waits for capacity.
    h = Harness(async_scheduling=True, depth=2, num_blocks=32, block_size=BS, max_num_seqs=1)
    h.add(make_request("a", list(range(8)), 6, BS))
    h.add(make_request("b", list(range(20, 28)), 6, BS))
    h.step()
    s = h.engine.stats().scheduler
    assert (s.num_waiting_reqs, s.num_waiting_reqs_deferred) == (1, 0)
    h.run_until_idle()
    # A preemption with a step in flight: the victim waits, deferred, until that step's
    # (stale) output is delivered, whatever room there is.
    h = Harness(async_scheduling=True, depth=2, num_blocks=7, block_size=BS)
    seen: list[tuple[int, int]] = []

    def after_schedule(so) -> None:
        if so.preempted_req_ids:
            st = h.scheduler.make_stats()
            stale = sum(1 for r in h.scheduler.waiting if r.num_stale_output_tokens)
            seen.append((st.num_waiting_reqs_deferred, stale))
    h.on_schedule.append(after_schedule)
    h.add(make_request("a", list(range(10)), 12, BS))
    h.add(make_request("b", list(range(40, 50)), 12, BS))
    h.run_until_idle()
    h.assert_all_released()
    assert seen and all(d == stale for d, stale in seen) and any(d > 0 for d, _ in seen)
