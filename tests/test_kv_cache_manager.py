"""KV cache manager: slot allocation, prefix lookup, publication frontier, release order."""

from __future__ import annotations

from forerun.core.kv_cache_manager import KVCacheManager
from tests.harness import make_request

BS = 4


def test_allocate_slots_takes_ceil_of_tokens_over_block_size():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(9)), max_tokens=4, block_size=BS)
    new = kv.allocate_slots(req, 9)
    assert new is not None and len(new) == 3  # ceil(9 / 4)
    assert kv.num_free_blocks == 7
    req.num_computed_tokens = 9
    # Positions 9..11 fit in the third block: nothing new.
    assert kv.allocate_slots(req, 3) == []
    req.num_computed_tokens = 12
    assert len(kv.allocate_slots(req, 1) or []) == 1


def test_allocate_fails_without_side_effects_when_pool_too_small():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    req = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2
    assert "a" not in kv.req_to_blocks


def test_reserved_tokens_must_fit_but_are_not_taken():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    req = make_request("a", list(range(16)), max_tokens=4, block_size=BS)
    # A 4-token chunk with 12 more to come needs 4 blocks in all: refused.
    assert kv.allocate_slots(req, 4, num_reserved_tokens=12) is None
    kv2 = KVCacheManager(num_blocks=4, block_size=BS)
    new = kv2.allocate_slots(req, 4, num_reserved_tokens=12)
    assert new is not None and len(new) == 1 and kv2.num_free_blocks == 3


def test_schedule_time_publication_caps_at_known_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)), max_tokens=4, block_size=BS)
    kv.allocate_slots(req, 10)
    # 10 known tokens: two full blocks published, the partial third is not.
    assert kv.num_cached_block["a"] == 2
    blocks = kv.get_blocks("a")
    assert [b.block_hash for b in blocks] == [req.block_hashes[0], req.block_hashes[1], None]


def test_chunk_publishes_only_what_it_computes():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    kv.allocate_slots(req, 6)  # chunk of 6: block 0 full and computed, block 1 half
    assert kv.num_cached_block["a"] == 1


def test_cache_blocks_is_monotone_and_idempotent():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    kv.allocate_slots(req, 5)
    assert kv.num_cached_block["a"] == 1
    kv.cache_blocks(req, 3)  # a lower frontier never unpublishes
    assert kv.num_cached_block["a"] == 1
    kv.cache_blocks(req, 8)
    kv.cache_blocks(req, 8)
    assert kv.num_cached_block["a"] == 2


def test_prefix_lookup_stops_before_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_request("a", list(range(8)), max_tokens=4, block_size=BS)
    kv.allocate_slots(first, 8)
    assert kv.num_cached_block["a"] == 2
    # Same 8 tokens: the last token must be recomputed, so only (8 - 1) // 4 = 1 block hits.
    same = make_request("b", list(range(8)), max_tokens=4, block_size=BS)
    hits, n = kv.get_computed_blocks(same)
    assert n == 4 and [b.block_id for b in hits] == [kv.get_blocks("a")[0].block_id]
    # One more token: both blocks hit.
    longer = make_request("c", list(range(9)), max_tokens=4, block_size=BS)
    hits, n = kv.get_computed_blocks(longer)
    assert n == 8 and len(hits) == 2


def test_prefix_lookup_stops_at_first_miss():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    first = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    kv.allocate_slots(first, 12)
    other = make_request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12], 4, BS)
    _, n = kv.get_computed_blocks(other)
    assert n == 4


def test_hit_on_free_cached_block_consumes_free_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    first = make_request("a", list(range(8)), max_tokens=4, block_size=BS)
    kv.allocate_slots(first, 8)
    kv.free(first)
    assert kv.num_free_blocks == 3
    second = make_request("b", list(range(9)), max_tokens=4, block_size=BS)
    hits, n = kv.get_computed_blocks(second)
    assert n == 8
    new = kv.allocate_slots(second, 1, n, hits)
    assert new is not None and len(new) == 1
    assert kv.num_free_blocks == 0
    assert [b.ref_cnt for b in kv.get_blocks("b")] == [1, 1, 1]


def test_remove_request_returns_blocks_tail_first_so_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    req = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    kv.allocate_slots(req, 12)
    ids = kv.get_block_ids("a")
    kv.free(req)
    # All three are cached, so they are appended in the order freed: tail first.
    order = [b.block_id for b in kv.block_pool.free_block_queue]
    assert order[-3:] == list(reversed(ids))
    assert "a" not in kv.req_to_blocks and "a" not in kv.num_cached_block


def test_caching_disabled_publishes_nothing_and_finds_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(12)), max_tokens=4, block_size=BS)
    kv.allocate_slots(req, 12)
    assert all(b.block_hash is None for b in kv.get_blocks("a"))
    again = make_request("b", list(range(13)), max_tokens=4, block_size=BS)
    assert kv.get_computed_blocks(again) == ([], 0)


def test_fenced_free_parks_blocks_until_the_fence_step_is_processed():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)), max_tokens=4, block_size=BS)
    b = make_request("b", list(range(100, 104)), max_tokens=4, block_size=BS)
    kv.allocate_slots(a, 8)
    kv.allocate_slots(b, 4)
    kv.free(a, fence_step_seq=2)
    kv.free(b, fence_step_seq=3)
    assert [fence for fence, _ in kv.deferred_frees] == [2, 3]
    assert (kv.num_free_blocks, kv.num_deferred_blocks, kv.usage) == (1, 3, 0.75)
    c = make_request("c", list(range(200, 209)), max_tokens=4, block_size=BS)
    # Three blocks: one free now, two more once a fence falls.
    assert kv.allocate_slots(c, 9) is None
    assert kv.deferred_blocks_would_fit(c, 9)
    kv.free_deferred(1)
    assert kv.num_deferred_blocks == 3
    kv.free_deferred(2)
    assert (kv.num_free_blocks, kv.num_deferred_blocks) == (3, 1)
    assert kv.allocate_slots(c, 9) is not None
    kv.free(c)
    kv.free_deferred(3)
    assert not kv.deferred_frees and kv.num_free_blocks == kv.num_blocks == 4
    assert not kv.deferred_blocks_would_fit(c, 9)  # nothing parked: preempt instead
