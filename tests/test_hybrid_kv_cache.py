"""The hybrid KV cache manager: layer groups, sliding-window release, per-group prefix hits.

The property tests drive random request streams through the real schedulers with the fake
worker (tests.harness), on a hybrid spec, at queue depths 1-3. After every event the harness
checks, besides the scheduler's own invariants: no sliding group holds a block wholly before
what its newest step can see (and holds every block a later query can), every block a step
in flight reads or writes is still its request's or parked behind a fence that step has not
passed, no block is in two requests' tables unless it is a shared prefix-cache block, and
reference counts match; at the end every block is free.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun.core.hybrid_kv_cache_manager import HybridKVCacheManager
from forerun.core.kv_cache_manager import cdiv
from forerun.core.kv_cache_spec import (
    KVCacheGroupSpec,
    KVCacheSpec,
    group_layers,
    kv_bytes_per_block,
    kv_cache_groups,
    layer_kv_slots,
    num_kv_slots,
)
from forerun.model.config import ModelConfig
from forerun.request import Request
from tests.harness import Harness, expected_output, make_request

BS = 4
ENGINES = [(False, 1), (True, 2), (True, 3)]


def hybrid_groups(window: int) -> list[KVCacheGroupSpec]:
    """2 full + 2 sliding layers, interleaved as in the models that have them."""
    return group_layers([None, window, None, window])


# ----- groups -------------------------------------------------------------------------------
def test_one_attention_type_is_one_group_of_every_layer():
    groups = group_layers([None] * 6)
    assert groups == [KVCacheGroupSpec(KVCacheSpec(), tuple(range(6)))]
    assert layer_kv_slots(groups) == [(0, j) for j in range(6)]


def test_groups_have_equal_layer_counts_and_layer_j_of_each_shares_slot_j():
    groups = group_layers([None, 8, None, 8])
    assert [(g.spec.sliding_window, g.layer_indices) for g in groups] == [
        (None, (0, 2)), (8, (1, 3))]
    assert layer_kv_slots(groups) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert num_kv_slots(groups) == 2


def test_a_layer_count_that_does_not_divide_pads_the_last_group():
    # 2 full + 5 sliding: groups of 2, the last sliding group has one layer (slot 1 padding).
    groups = group_layers([None, 16, 16, None, 16, 16, 16])
    assert [g.layer_indices for g in groups] == [(0, 3), (1, 2), (4, 5), (6,)]
    assert layer_kv_slots(groups)[6] == (3, 0)
    assert kv_bytes_per_block(groups, block_size=16, num_kv_heads=2, head_dim=64,
                              dtype_bytes=2) == 2 * 2 * 16 * 2 * 64 * 2


def test_groups_come_from_the_model_configs_layer_windows():
    mc = ModelConfig("LlamaForCausalLM", 64, 128, 4, 4, 2, 16, 100, 512, 1e4, 1e-5, False,
                     False, layer_types=["sliding_attention", "full_attention"] * 2,
                     sliding_window=32)
    groups = kv_cache_groups(mc)
    assert [(g.spec, g.layer_indices) for g in groups] == [
        (KVCacheSpec(), (1, 3)), (KVCacheSpec("sliding_attention", 32), (0, 2))]


# ----- prefix hits by hand ----------------------------------------------------------------
def _run_alone(kv: HybridKVCacheManager, req: Request) -> None:
    """Compute the whole prompt in one step and release the request (blocks stay cached)."""
    assert kv.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)


def _evict(kv: HybridKVCacheManager, gid: int, req: Request, index: int) -> None:
    """Let the pool reuse one free cached block (block ``index`` of group ``gid``) next."""
    pool = kv.block_pool
    block = pool.get_cached_block(kv.managers[gid].cache_key(req.block_hashes[index]))
    assert block is not None and block.ref_cnt == 0
    pool.free_block_queue.remove(block)
    pool.free_block_queue.appendleft(block)
    assert pool.get_new_blocks(1) == [block] and block.block_hash is None
    pool.free_blocks([block])


@pytest.mark.parametrize(("evicted", "expected_hit"), [
    ([], 24),                   # everything cached: the whole prefix (6 blocks)
    ([(1, 5)], 20),             # the window's tail block gone: the hit ends where it is whole
    ([(1, 0), (1, 2), (1, 4)], 0),  # no two adjacent sliding blocks: a miss, full group whole
    ([(0, 2)], 8),              # a hole in the full group's prefix bounds the hit
    ([(1, 0), (1, 1), (1, 2), (1, 3)], 24),  # blocks outside every window are not needed
])
def test_hit_needs_the_full_prefix_and_the_windows_tail(evicted, expected_hit):
    # Window 8: a query at L sees [L - 7, L], so a hit at L needs blocks of [L - 7, L).
    kv = HybridKVCacheManager(hybrid_groups(8), num_blocks=40, block_size=BS)
    prompt = list(range(100, 124))
    _run_alone(kv, make_request("a", prompt, 4, BS))
    for gid, index in evicted:
        _evict(kv, gid, make_request("probe", prompt, 4, BS), index)
    b = make_request("b", prompt + [7, 8, 9, 10], 4, BS)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == expected_hit
    if num_hit:
        full, sliding = hits
        assert len(full) == len(sliding) == num_hit // BS
        assert kv.null_block not in full
        # Only the window's tail (cdiv(7, 4) = 2 blocks) is real in the sliding group.
        assert [blk is kv.null_block for blk in sliding] == \
            [True] * (num_hit // BS - 2) + [False] * 2
        assert kv.allocate_slots(b, 28 - num_hit, num_hit, hits) is not None
        assert [blk.block_id for blk in kv.get_group_blocks("b")[1][:num_hit // BS]] == \
            [blk.block_id for blk in sliding]


def test_a_released_window_block_stays_cached_for_a_later_hit():
    kv = HybridKVCacheManager(hybrid_groups(8), num_blocks=40, block_size=BS)
    a = make_request("a", list(range(100, 124)), 4, BS)
    for _ in range(6):  # one block per step: each step releases what the window left
        assert kv.allocate_slots(a, BS) is not None
        a.num_computed_tokens += BS
    sliding = kv.get_group_blocks("a")[1]
    assert sliding[:3] == [kv.null_block] * 3 and kv.null_block not in sliding[3:]
    assert kv.num_live_blocks("a") == 6 + 3
    # Released without a fence (nothing in flight): back in the pool at once. The pool's
    # null block is not counted.
    stats = kv.make_stats()
    assert (stats.num_blocks, stats.num_free_blocks) == (40, 40 - 9)
    assert stats.usage == pytest.approx(9 / 40)
    b = make_request("b", list(range(100, 116)) + [1, 2], 4, BS)
    # 16 tokens of b are cached in the full group. Of the sliding blocks 2 and 3 that the
    # hit needs, 2 left a's window (free, still cached) and 3 is still a's.
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and hits[1][:2] == [kv.null_block] * 2
    assert hits[1][2].ref_cnt == 0 and hits[1][2] not in sliding
    assert hits[1][3] is sliding[3]


# ----- through the schedulers --------------------------------------------------------------
def _harness(groups, depth: int, async_scheduling: bool, **kw) -> Harness:
    return Harness(async_scheduling=async_scheduling, depth=depth, kv_cache_groups=groups,
                   **kw)


@pytest.mark.parametrize(("async_scheduling", "depth"), ENGINES)
def test_a_long_prompt_fits_with_only_the_window_live(async_scheduling: bool, depth: int):
    window, budget, plen, out = 8, 16, 400, 4
    groups = hybrid_groups(window)
    full_need = cdiv(plen + out, BS)
    bound = cdiv(window - 1 + budget, BS) + 1  # per step: W - 1 + n positions, misaligned
    num_blocks = full_need + bound
    # The same layers as two full-attention groups would need twice the prompt's blocks.
    all_full = [KVCacheGroupSpec(KVCacheSpec(), (0, 2)), KVCacheGroupSpec(KVCacheSpec(), (1, 3))]
    h_full = _harness(all_full, depth, async_scheduling, num_blocks=num_blocks, block_size=BS,
                      max_num_batched_tokens=budget)
    with pytest.raises(ValueError, match="KV blocks"):
        h_full.add(make_request("r", list(range(1000, 1000 + plen)), out, BS))
    h = _harness(groups, depth, async_scheduling, num_blocks=num_blocks, block_size=BS,
                 max_num_batched_tokens=budget)
    h.add(make_request("r", list(range(1000, 1000 + plen)), out, BS))
    h.run_until_idle()
    assert (h.outputs["r"], h.finish_reason["r"]) == expected_output("r", plen, out, None)
    assert 0 < h.max_live_sliding["r"] <= bound
    h.assert_all_released()


@st.composite
def hybrid_workloads(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([4, 16]))
    # Windows of 2-5 blocks, not always block-aligned; sometimes two sliding windows.
    windows = [draw(st.integers(2, 5)) * bs - draw(st.integers(0, bs - 1)) for _ in range(2)]
    layers = [None, windows[0], None, windows[0]]
    if draw(st.booleans()):
        layers = [None, windows[0], windows[1] + 1]
    budget = draw(st.integers(4, 48))
    base = [7000 + j for j in range(80)]
    reqs = []
    for i in range(draw(st.integers(1, 6))):
        plen = draw(st.integers(1, 80))
        # Shared prefixes (with their own tails), so that prefix hits and shared blocks
        # happen; arrivals spread out, so that some find the others' blocks cached.
        own = [10_000 * (i + 1) + j for j in range(plen)]
        prompt = base[:plen - draw(st.integers(0, plen - 1))] + own[:draw(st.integers(0, 8))] \
            if draw(st.integers(0, 2)) else own
        arrival = draw(st.integers(0, 16))
        abort_at = draw(st.none() | st.integers(arrival, arrival + 25))
        reqs.append((f"q{i}", prompt, draw(st.integers(1, 40)),
                     draw(st.none() | st.integers(1, 16)), arrival, abort_at))
    groups = group_layers(layers)
    probe = HybridKVCacheManager(groups, 1, bs)
    # Tight pools: the largest request just fits alone, so concurrency preempts.
    need = max(probe.max_blocks_per_request(len(p) + m, budget) for _, p, m, *_ in reqs)
    need = max(need, 2)
    return {"bs": bs, "groups": groups, "budget": budget, "reqs": reqs,
            "num_blocks": need + draw(st.integers(0, need // 2)),
            "max_num_seqs": draw(st.integers(1, 6)), "caching": draw(st.integers(0, 3)) > 0}


def _run(w: dict, async_scheduling: bool, depth: int) -> Harness:
    h = _harness(w["groups"], depth, async_scheduling, num_blocks=w["num_blocks"],
                 block_size=w["bs"], max_num_batched_tokens=w["budget"],
                 max_num_seqs=w["max_num_seqs"], enable_caching=w["caching"],
                 eos_at={rid: e for rid, _, _, e, _, _ in w["reqs"] if e is not None})
    last = max(max(arr, ab or 0) for *_, arr, ab in w["reqs"])
    call = 0
    while call <= last or h.engine.has_work():
        for rid, prompt, max_tokens, _, arrival, _ in w["reqs"]:
            if arrival == call:
                h.add(make_request(rid, prompt, max_tokens, w["bs"]))
        for rid, *_, abort_at in w["reqs"]:
            if abort_at == call:
                h.abort(rid)
        h.step()
        call += 1
        assert call < 3_000, "engine made no progress"
    h.assert_all_released()
    return h


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_workloads())
def test_hybrid_streams_keep_every_invariant_and_lose_no_token(w: dict):
    for async_scheduling, depth in ENGINES:
        h = _run(w, async_scheduling, depth)
        for rid, prompt, max_tokens, eos_at, _, _ in w["reqs"]:
            want, reason = expected_output(rid, len(prompt), max_tokens, eos_at)
            got = h.outputs[rid]
            if h.finish_reason[rid] == "abort":
                assert got == want[:len(got)], (depth, rid)
            else:
                assert (got, h.finish_reason[rid]) == (want, reason), (depth, rid)


def test_single_group_output_keeps_the_one_list_shape():
    h = Harness(async_scheduling=True, depth=2, num_blocks=16, block_size=BS,
                kv_cache_groups=group_layers([None, None]))
    assert type(h.kv).__name__ == "KVCacheManager"
    seen = []
    h.on_schedule.append(lambda so: seen.extend(
        [n.block_ids for n in so.scheduled_new_reqs] + so.scheduled_cached_reqs.new_block_ids))
    h.add(make_request("a", list(range(9)), 6, BS))
    h.run_until_idle()
    assert seen and all(isinstance(ids, tuple) and len(ids) == 1 for ids in seen)
    h.assert_all_released()
