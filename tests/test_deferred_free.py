"""Deferred block frees: blocks of a finished/aborted/preempted request stay parked until
every step that may still write them has been processed (the step-sequence fence).

Step numbers below count non-empty scheduled steps (``sched_step_seq``). With a batch
queue of depth d, engine call k (1-based) schedules step k and, once the queue is full,
processes step k - d + 1 before returning.
"""

from __future__ import annotations

from forerun.core.output import SchedulerOutput
from forerun.request import RequestStatus
from tests.harness import Harness, expected_output, make_request

BS = 4


def harness(depth: int = 2, num_blocks: int = 32, **kw) -> Harness:
    return Harness(async_scheduling=depth > 1, depth=depth, num_blocks=num_blocks,
                   block_size=BS, defer_block_free=True, **kw)


def prompt(i: int, n: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(n)]


def parked_ids(h: Harness) -> list[list[int]]:
    return [sorted(b.block_id for b in blocks) for _, blocks in h.kv.deferred_frees]


def free_ids(h: Harness) -> set[int]:
    return {b.block_id for b in h.kv.block_pool.free_block_queue}


def test_eos_finish_with_a_step_in_flight_defers_until_that_step_is_processed():
    # r takes 3 of 4 blocks (10 prompt tokens + the decode position 10 -> ceil(11/4)).
    h = harness(num_blocks=4, eos_at={"r": 1})
    h.add(make_request("r", prompt(0, 10), 8, BS))
    h.step()  # schedules step 1 (prefill)
    r_blocks = sorted(h.kv.get_block_ids("r"))
    assert len(r_blocks) == 3
    h.step()  # schedules step 2 (decode, placeholder), processes step 1: EOS
    assert h.finish_reason["r"] == "stop"
    # Step 2 is still in flight and would write r's last block: parked behind fence 2.
    assert [fence for fence, _ in h.kv.deferred_frees] == [2]
    assert parked_ids(h) == [r_blocks]
    assert h.kv.num_free_blocks == 1
    # A newcomer needing three blocks cannot take them while step 2 runs.
    h.add(make_request("b", prompt(1, 9), 2, BS))
    h.step()  # b cannot be admitted; processing step 2 releases r's blocks
    assert h.scheduled_tokens["b"] == 0
    assert not h.kv.deferred_frees and h.kv.num_free_blocks == 4
    h.step()
    assert h.scheduled_tokens["b"] == 9
    # b's three blocks come from a pool whose only other block is the never-used one.
    assert len(set(h.kv.get_block_ids("b")) & set(r_blocks)) >= 2
    h.run_until_idle()
    assert (h.outputs["b"], h.finish_reason["b"]) == expected_output("b", 9, 2, None)
    h.assert_all_released()


def test_finish_with_nothing_in_flight_frees_at_once():
    h = harness()
    h.add(make_request("r", prompt(0, 6), 1, BS))
    freed_at_update: list[int] = []
    h.on_update.append(lambda so: freed_at_update.append(h.kv.num_free_blocks))
    h.step()  # step 1: prefill, samples the only token
    h.step()  # nothing more to schedule for r (max_tokens guard); step 1 processed
    assert h.finish_reason["r"] == "length"
    assert h.scheduler.sched_step_seq == 1
    assert not h.kv.deferred_frees
    assert freed_at_update[0] == 32
    h.run_until_idle()
    h.assert_all_released()


def test_sync_engine_with_deferral_on_frees_at_once():
    h = harness(depth=1, eos_at={"r": 2})
    h.add(make_request("r", prompt(0, 6), 5, BS))
    h.step()
    h.step()
    assert h.finish_reason["r"] == "stop"
    assert not h.kv.deferred_frees and h.kv.num_free_blocks == 32
    h.assert_all_released()


def test_abort_with_a_step_in_flight_defers():
    h = harness()
    h.add(make_request("r", prompt(0, 6), 50, BS))
    for _ in range(3):
        h.step()  # after call 3: step 3 in flight, steps 1-2 processed
    r_blocks = sorted(h.kv.get_block_ids("r"))
    h.abort("r")
    assert [fence for fence, _ in h.kv.deferred_frees] == [3]
    assert parked_ids(h) == [r_blocks]
    assert h.kv.num_free_blocks == 32 - len(r_blocks)
    h.step()  # processes step 3
    assert not h.kv.deferred_frees
    h.assert_all_released()


def test_preemption_detaches_blocks_at_once_and_defers_their_free():
    # Two requests of 4 prompt tokens, 10 outputs each: alone each needs
    # ceil((4 + 10 - 1) / 4) = 4 blocks, the whole pool, so decoding both must preempt.
    h = harness(num_blocks=4)
    seen: list[dict] = []

    def on_schedule(so: SchedulerOutput) -> None:
        for rid in so.preempted_req_ids:
            victim = h.scheduler.requests[rid]
            seen.append({
                "status": victim.status,
                "in_manager": rid in h.kv.req_to_blocks,
                "fences": [f for f, _ in h.kv.deferred_frees],
                "newest_step": h.scheduler.sched_step_seq,
                "processed": h.scheduler.processed_step_seq,
                "free": h.kv.num_free_blocks,
            })

    h.on_schedule.append(on_schedule)
    for i in range(2):
        h.add(make_request(f"r{i}", prompt(i, 4), 10, BS))
    h.run_until_idle()
    assert h.scheduler.counters.num_preemptions > 0
    first = seen[0]
    assert first["status"] == RequestStatus.PREEMPTED
    assert first["in_manager"] is False  # detached: it can be rescheduled cleanly
    assert first["fences"] and first["fences"][-1] > first["processed"]
    assert first["free"] == 0  # the victim's blocks are parked, not yet free
    for i in range(2):
        rid = f"r{i}"
        assert (h.outputs[rid], h.finish_reason[rid]) == expected_output(rid, 4, 10, None)
    h.assert_all_released()


def test_multiple_deferred_entries_drain_in_fence_order():
    h = harness(depth=3)
    for i in range(3):
        h.add(make_request(f"r{i}", prompt(i, 6), 50, BS))
    for _ in range(3):
        h.step()  # steps 1-3 scheduled, step 1 processed
    a_blocks = sorted(h.kv.get_block_ids("r0"))
    h.abort("r0")  # newest step is 3
    h.step()  # schedules step 4, processes step 2
    b_blocks = sorted(h.kv.get_block_ids("r1"))
    h.abort("r1")  # newest step is 4
    assert [f for f, _ in h.kv.deferred_frees] == [3, 4]
    assert parked_ids(h) == [a_blocks, b_blocks]
    h.step()  # schedules step 5, processes step 3: only the first entry's fence is met
    assert parked_ids(h) == [b_blocks]
    assert set(a_blocks) <= free_ids(h)
    assert set(b_blocks).isdisjoint(free_ids(h))
    h.step()  # processes step 4
    assert not h.kv.deferred_frees
    assert set(b_blocks) <= free_ids(h)
    h.abort("r2")
    h.run_until_idle()
    h.assert_all_released()


def test_fence_holds_across_three_steps_in_flight_until_the_newest_is_processed():
    h = harness(depth=3)
    h.add(make_request("r", prompt(0, 6), 50, BS))
    state: dict[str, object] = {}

    def abort_with_three_in_flight(so: SchedulerOutput) -> None:
        if so.step_id == 4 and "blocks" not in state:
            assert len(h.in_flight) == 3  # steps 3, 4 and 5 (ids 2, 3, 4)
            state["blocks"] = sorted(h.kv.get_block_ids("r"))
            h.abort("r")

    h.on_schedule.append(abort_with_three_in_flight)
    parked_after_update: list[bool] = []
    h.on_update.append(lambda so: parked_after_update.append(bool(h.kv.deferred_frees)))
    h.run_until_idle()
    assert "blocks" in state
    # Updates: steps 1, 2 before the abort; then steps 3 and 4 keep the blocks parked
    # (fence 5); processing step 5 releases them.
    assert parked_after_update == [False, False, True, True, False]
    h.assert_all_released()


def test_max_tokens_finish_frees_at_once_while_other_requests_are_in_flight():
    h = harness()
    h.add(make_request("short", prompt(0, 6), 2, BS))
    h.add(make_request("long", prompt(1, 6), 30, BS))
    h.step()  # step 1: both prefill
    h.step()  # step 2: both decode; "short" now has all its tokens promised
    short_blocks = set(h.kv.get_block_ids("short"))
    h.step()  # step 3: only "long"; processing step 2 finishes "short"
    assert h.finish_reason["short"] == "length"
    assert h.executor.executed[-1].num_scheduled_tokens == {"long": 1}
    assert len(h.in_flight) == 1  # step 3 is still running
    # "short" was last scheduled in step 2, which is processed: nothing to wait for.
    assert not h.kv.deferred_frees
    assert short_blocks <= free_ids(h)
    h.run_until_idle()
    h.assert_all_released()


def test_abort_mid_prefill_chunk_defers():
    h = harness(max_num_batched_tokens=4)
    h.add(make_request("r", prompt(0, 20), 5, BS))
    h.step()  # step 1: the first 4-token chunk, in flight
    r = h.scheduler.requests["r"]
    assert r.is_prefill_chunk and r.num_computed_tokens == 4
    blocks = sorted(h.kv.get_block_ids("r"))
    h.abort("r")
    assert [f for f, _ in h.kv.deferred_frees] == [1]
    assert parked_ids(h) == [blocks]
    h.step()  # processes step 1
    h.assert_all_released()
