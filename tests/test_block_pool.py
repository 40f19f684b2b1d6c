"""Block pool and block hashing: free-list order, reference counts, the prefix-cache map."""

from __future__ import annotations

import pytest

from forerun.core.block_hash import NONE_HASH, hash_block_tokens, make_block_hasher
from forerun.core.block_pool import BlockPool
from forerun.request import Request
from forerun.sampling_params import SamplingParams


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def fake_hash(i: int) -> bytes:
    return bytes([i]) * 32


def test_fresh_pool_hands_out_blocks_in_id_order_with_one_reference():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 2
    assert free_order(pool) == [3, 4]


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


def test_freed_uncached_blocks_are_reused_first_cached_ones_go_to_the_back():
    pool = BlockPool(6)
    a, b, c, d = pool.get_new_blocks(4)  # free list now [4, 5]
    pool.cache_full_blocks([a, b], [fake_hash(1), fake_hash(2)], 0, 2)
    # Freed in the order given: cached a then b appended (LRU), uncached c then d
    # prepended (each new one lands in front of the previous).
    pool.free_blocks([a, b, c, d])
    assert free_order(pool) == [3, 2, 4, 5, 0, 1]
    # Reuse takes the front: the uncached blocks, then the never-used ones.
    got = pool.get_new_blocks(4)
    assert [x.block_id for x in got] == [3, 2, 4, 5]
    # The cached blocks are still findable: nothing evicted them.
    assert pool.get_cached_block(fake_hash(1)) is a
    assert pool.get_cached_block(fake_hash(2)) is b


def test_allocating_a_free_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [fake_hash(7)], 0, 1)
    pool.free_blocks([a])
    assert pool.get_cached_block(fake_hash(7)) is a
    [again] = pool.get_new_blocks(1)
    assert again is a
    assert a.block_hash is None
    assert pool.get_cached_block(fake_hash(7)) is None
    assert pool.cached_block_hash_to_block == {}


def test_touch_of_free_cached_block_removes_it_from_free_list():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [fake_hash(1)], 0, 1)
    pool.free_blocks([a])
    assert a.block_id in free_order(pool)
    pool.touch([a])
    assert a.ref_cnt == 1
    assert a.block_id not in free_order(pool)
    assert pool.get_num_free_blocks() == 2
    # A second holder only bumps the count.
    pool.touch([a])
    assert a.ref_cnt == 2
    assert pool.get_num_free_blocks() == 2


def test_shared_block_returns_to_free_list_only_when_last_reference_drops():
    pool = BlockPool(3)
    [a] = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [fake_hash(3)], 0, 1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and a.block_id not in free_order(pool)
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and free_order(pool)[-1] == a.block_id


def test_double_free_raises():
    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_free_list_remove_of_a_block_not_in_it_raises():
    pool = BlockPool(2)
    [a] = pool.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        pool.free_block_queue.remove(a)


def test_two_blocks_may_share_a_hash_and_evicting_one_keeps_the_other():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [fake_hash(9)], 0, 1)
    pool.cache_full_blocks([b], [fake_hash(9)], 0, 1)
    assert set(pool.cached_block_hash_to_block[fake_hash(9)]) == {a.block_id, b.block_id}
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # takes the never-used block 2, then a (evicted)
    assert a.block_hash is None
    assert pool.get_cached_block(fake_hash(9)) is b


# ----- hashing ----------------------------------------------------------------------------

def make_req(tokens: list[int], block_size: int, cache_salt: str | None = None) -> Request:
    return Request("h", tokens, SamplingParams(max_tokens=4), cache_salt=cache_salt,
                   block_hasher=make_block_hasher(block_size))


def test_only_full_blocks_are_hashed_and_appends_complete_them():
    req = make_req(list(range(10)), block_size=4)
    assert len(req.block_hashes) == 2  # 10 // 4
    req.append_output_token_ids([10])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11])
    assert len(req.block_hashes) == 3
    # The incremental hash equals hashing the whole sequence at once.
    whole = make_req(list(range(12)), block_size=4)
    assert req.block_hashes == whole.block_hashes


def test_chain_hash_is_parent_then_tokens():
    req = make_req([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert req.block_hashes == [h0, hash_block_tokens(h0, [5, 6, 7, 8])]


def test_same_block_with_different_parent_hashes_differently():
    a = make_req([1, 2, 3, 4, 9, 9, 9, 9], block_size=4)
    b = make_req([1, 2, 3, 5, 9, 9, 9, 9], block_size=4)
    assert a.block_hashes[0] != b.block_hashes[0]
    # Identical second-block tokens, different prefix: different hash.
    assert a.block_hashes[1] != b.block_hashes[1]


def test_cache_salt_changes_every_hash_and_same_salt_matches():
    tokens = list(range(8))
    plain = make_req(tokens, 4)
    salted = make_req(tokens, 4, cache_salt="tenant-a")
    other = make_req(tokens, 4, cache_salt="tenant-b")
    same = make_req(tokens, 4, cache_salt="tenant-a")
    assert plain.block_hashes[0] != salted.block_hashes[0] != other.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]  # the chain carries the salt
    assert salted.block_hashes == same.block_hashes
