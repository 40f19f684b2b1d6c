"""vLLM's async-scheduler acceptance scenarios, through the real AsyncScheduler + EngineCore.

Every scenario runs in :class:`tests.harness.Harness`, which checks the scheduler's
invariants after every schedule and every update event.
"""

from __future__ import annotations

import pytest

from forerun.request import RequestStatus
from tests.fake_executor import token_for
from tests.harness import Harness, expected_output, make_request


def distinct_prompt(index: int, length: int) -> list[int]:
    """Prompts that share no block with each other."""
    return [1000 * (index + 1) + j for j in range(length)]


# ----- (a) max_tokens: no wasted step ---------------------------------------------------

@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_finish_schedules_no_extra_step(max_tokens, depth):
    h = Harness(async_scheduling=True, depth=depth, num_blocks=64, block_size=16)
    lens = {"a": 20, "b": 33}
    h.add(make_request("a", distinct_prompt(0, lens["a"]), max_tokens, 16))
    h.step()
    h.add(make_request("b", distinct_prompt(1, lens["b"]), max_tokens, 16))
    h.run_until_idle()

    for rid, plen in lens.items():
        assert (h.outputs[rid], h.finish_reason[rid]) == expected_output(
            rid, plen, max_tokens, None)
        # The prompt once, then one position per output except the last one sampled.
        assert h.scheduled_tokens[rid] == plen + max_tokens - 1
        worker_side = sum(so.num_scheduled_tokens.get(rid, 0) for so in h.executor.executed)
        assert worker_side == plen + max_tokens - 1
    assert h.scheduler.counters.wasted_tokens == 0
    h.assert_all_released()


def test_eos_finish_wastes_exactly_the_steps_behind_it():
    # Depth 2: when the EOS arrives one decode step for the request is already in flight.
    h = Harness(async_scheduling=True, depth=2, num_blocks=64, block_size=16,
                eos_at={"a": 3})
    h.add(make_request("a", distinct_prompt(0, 10), 8, 16))
    h.run_until_idle()
    assert (h.outputs["a"], h.finish_reason["a"]) == expected_output("a", 10, 8, 3)
    assert h.scheduler.counters.wasted_tokens == 1
    h.assert_all_released()


# ----- (b) aborts while steps are in flight ----------------------------------------------

@pytest.mark.parametrize("depth", [2, 3])
def test_aborts_in_scrambled_order_keep_exactly_the_delivered_outputs(depth):
    order = [3, 0, 5, 1, 4, 2]
    h = Harness(async_scheduling=True, depth=depth, num_blocks=64, block_size=16)
    requests = {}
    for i in range(6):
        req = make_request(f"r{i}", distinct_prompt(i, 8), 100, 16)
        requests[req.request_id] = req
        h.add(req)
    # Each call schedules one step; the queue fills after `depth` calls, and from then on
    # every call also processes the oldest step: after k calls each live request has
    # k - (depth - 1) outputs (one step holds all prompts; each later step samples once).
    for _ in range(depth):
        h.step()
    calls = depth
    for victim in order:
        rid = f"r{victim}"
        assert len(h.outputs[rid]) == calls - (depth - 1)
        h.abort(rid)
        h.step()
        calls += 1
    h.run_until_idle()

    for pos, victim in enumerate(order):
        rid = f"r{victim}"
        delivered = depth + pos - (depth - 1)
        assert requests[rid].status == RequestStatus.FINISHED_ABORTED
        assert h.finish_reason[rid] == "abort"
        assert h.outputs[rid] == expected_output(rid, 8, 100, None)[0][:delivered]
    # Each abort threw away the (depth - 1) steps that were in flight for the request.
    assert h.scheduler.counters.wasted_tokens == 6 * (depth - 1)
    h.assert_all_released()


@pytest.mark.parametrize("depth", [2, 3])
def test_aborts_with_a_full_queue_in_flight_discard_every_in_flight_step(depth):
    # Abort right after a call has scheduled its step and before it processes the
    # oldest: `depth` steps of the victim are in flight and all of them are discarded.
    order = [2, 0, 3, 1]
    h = Harness(async_scheduling=True, depth=depth, num_blocks=64, block_size=16)
    for i in range(4):
        h.add(make_request(f"r{i}", distinct_prompt(i, 8), 100, 16))
    victims = iter(order)
    aborted_with: dict[str, int] = {}

    def abort_next(so):
        if so.step_id < depth:  # let the queue fill first
            return
        rid = next(victims, None)
        if rid is None:
            return
        rid = f"r{rid}"
        assert len(h.in_flight) == depth
        aborted_with[rid] = len(h.outputs[rid])
        h.abort(rid)

    h.on_schedule.append(abort_next)
    h.run_until_idle()
    for pos, victim in enumerate(order):
        rid = f"r{victim}"
        # Call k = depth + 1 + pos schedules step k and aborts before processing step
        # k - depth + 1; the victim holds the outputs of steps 1 .. k - depth.
        assert aborted_with[rid] == 1 + pos
        assert h.outputs[rid] == expected_output(rid, 8, 100, None)[0][: 1 + pos]
        assert h.finish_reason[rid] == "abort"
    assert h.scheduler.counters.wasted_tokens == 4 * depth
    h.assert_all_released()


def test_abort_of_a_waiting_request_never_schedules_it():
    h = Harness(async_scheduling=True, depth=2, num_blocks=64, block_size=16,
                max_num_seqs=1)
    h.add(make_request("a", distinct_prompt(0, 8), 4, 16))
    h.add(make_request("b", distinct_prompt(1, 8), 4, 16))
    h.step()
    h.abort("b")
    h.run_until_idle()
    assert h.scheduled_tokens["b"] == 0 and h.outputs["b"] == []
    assert h.finish_reason["b"] == "abort"
    assert (h.outputs["a"], h.finish_reason["a"]) == expected_output("a", 8, 4, None)
    h.assert_all_released()


# ----- (c) prefix-cache de-dup in one step -----------------------------------------------

def test_identical_prompts_in_one_step_share_published_prefix_blocks():
    bs, plen = 16, 100
    prompt = distinct_prompt(0, plen)
    h = Harness(async_scheduling=True, depth=2, num_blocks=64, block_size=bs)
    h.add(make_request("a", prompt, 4, bs))
    h.add(make_request("b", prompt, 4, bs))
    h.step()
    [first] = h.executor.executed
    # a's six full blocks were published when a was scheduled; b, admitted in the same
    # step, hits them and computes only the 100 % 16 = 4 trailing tokens.
    assert first.num_scheduled_tokens == {"a": plen, "b": plen % bs}
    assert h.kv.get_block_ids("b")[: plen // bs] == h.kv.get_block_ids("a")[: plen // bs]
    h.step()
    h.add(make_request("c", prompt, 4, bs))
    h.step()
    # A later identical arrival: hit length (100 - 1) // 16 * 16 = 96, 4 left.
    assert h.executor.executed[-1].num_scheduled_tokens["c"] == plen - 96
    h.run_until_idle()
    for rid in "abc":
        assert (h.outputs[rid], h.finish_reason[rid]) == expected_output(rid, plen, 4, None)
    h.assert_all_released()


# ----- (d) multi-turn prefix caching ------------------------------------------------------

@pytest.mark.parametrize("async_scheduling,depth", [(False, 1), (True, 2), (True, 3)])
@pytest.mark.parametrize("max_tokens", [40, 47])
def test_second_turn_hits_every_full_block_of_first_turn(async_scheduling, depth, max_tokens):
    bs, plen = 16, 50
    prompt = distinct_prompt(0, plen)
    h = Harness(async_scheduling=async_scheduling, depth=depth, num_blocks=64, block_size=bs)
    h.add(make_request("turn1", prompt, max_tokens, bs))
    h.run_until_idle()
    assert len(h.outputs["turn1"]) == max_tokens

    # The first turn computed positions 0 .. plen + max_tokens - 2 (its last token never
    # went through the model), so (plen + max_tokens - 1) // 16 blocks are final. For
    # max_tokens=47 that is 96 // 16 = 6 blocks; the sixth block is completed by the last
    # decode step, which under async scheduling is published only by the update path.
    turn2 = make_request("turn2", prompt + h.outputs["turn1"], 4, bs)
    h.add(turn2)
    h.step()
    hit_blocks = (plen + max_tokens - 1) // bs
    # The new prompt has plen + max_tokens tokens; lookup stops before the last token,
    # which allows (plen + max_tokens - 1) // 16 blocks: the same number.
    assert turn2.num_cached_tokens == hit_blocks * bs
    assert h.executor.executed[-1].num_scheduled_tokens["turn2"] == (
        plen + max_tokens - hit_blocks * bs)
    h.run_until_idle()
    assert (h.outputs["turn2"], h.finish_reason["turn2"]) == expected_output(
        "turn2", plen + max_tokens, 4, None)
    h.assert_all_released()


def test_async_publishes_the_last_decoded_block_only_when_its_output_arrives():
    # 50 + 47 - 1 = 96 computed positions: block 5 (positions 80..95) is completed by the
    # final decode step, scheduled while position 95's id was still a placeholder.
    bs = 16
    h = Harness(async_scheduling=True, depth=2, num_blocks=64, block_size=bs)
    req = make_request("a", distinct_prompt(0, 50), 47, bs)
    h.add(req)
    seen: list[tuple[int, int]] = []

    def record(_so):
        if "a" in h.scheduler.requests:
            seen.append((req.num_output_tokens, h.kv.num_cached_block.get("a", 0)))

    h.on_update.append(record)
    h.run_until_idle()
    # After k outputs the confirmed frontier C - P is 50 + k - 1: with 46 outputs it is 95,
    # so block 5 is not yet publishable (and the schedule-time call capped at the 95
    # known ids when the final step was scheduled).
    assert (46, 5) in seen
    # The 47th output moves the frontier to 96 and the update path publishes block 5
    # before the request's blocks are released.
    assert len(req.block_hashes) == 6
    cached = h.kv.block_pool.get_cached_block(req.block_hashes[5])
    assert cached is not None and cached.ref_cnt == 0


# ----- (e) preemption under KV pressure with output in flight -----------------------------

PRESSURE = [  # (prompt_len, max_tokens, arrival call)
    (10, 12, 0), (7, 15, 1), (13, 9, 2), (5, 14, 3), (9, 11, 4), (12, 10, 6),
]


@pytest.mark.parametrize("async_scheduling,depth", [(False, 1), (True, 2), (True, 3)])
def test_preemption_under_kv_pressure_is_lossless(async_scheduling, depth):
    bs = 4
    # Every request alone fits (at most ceil((13 + 9 - 1) / 4) = 6 blocks); the pool
    # holds two of them at most, so concurrent decoding must preempt.
    h = Harness(async_scheduling=async_scheduling, depth=depth, num_blocks=11, block_size=bs,
                max_num_batched_tokens=16, eos_at={"r4": 6})
    calls = 0
    pending = sorted(PRESSURE, key=lambda x: x[2])
    index = 0
    while pending[index:] or h.engine.has_work():
        while index < len(pending) and pending[index][2] <= calls:
            plen, mt, _ = pending[index]
            h.add(make_request(f"r{index}", distinct_prompt(index, plen), mt, bs))
            index += 1
        h.step()
        calls += 1
        assert calls < 2000
    assert h.scheduler.counters.num_preemptions > 0
    if async_scheduling:
        # At least one victim had output in flight when it was preempted.
        assert any(stale > 0 for _, stale in h.preemptions)
    assert h.min_placeholders_seen >= 0
    for i, (plen, mt, _) in enumerate(pending):
        rid = f"r{i}"
        ids, reason = expected_output(rid, plen, mt, h.eos_at.get(rid))
        assert (h.outputs[rid], h.finish_reason[rid]) == (ids, reason)
        # Spelled out for the first token: it was sampled for position plen.
        assert h.outputs[rid][0] == token_for(rid, plen)
    h.assert_all_released()
