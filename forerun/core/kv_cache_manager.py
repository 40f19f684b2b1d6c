"""Per-request KV block bookkeeping on top of the block pool."""

from __future__ import annotations

import logging
from collections import deque

from forerun.core.block_pool import BlockPool, KVCacheBlock
from forerun.core.stats import KVCacheStats
from forerun.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out blocks to requests, finds prefix-cache hits and publishes full blocks.

    A block is published (given its hash) only when every token in it is known *and* a
    KV write for it has been enqueued: callers pass the frontier they can vouch for.

    Freeing can be fenced: :meth:`free` with a step sequence number parks the blocks in
    ``deferred_frees`` until :meth:`free_deferred` learns that step has been processed,
    because a step still in flight may write them. The scheduler numbers the steps.
    """

    # Whether allocate_slots may release blocks of a running request (a sliding window;
    # only the hybrid manager, which has several groups).
    releases_blocks_while_running = False

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # (fence step seq, blocks tail first), fences non-decreasing: freed in order once
        # the fence step has been processed.
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()
        # Prefix-cache lookups, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----- accounting ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_deferred_blocks(self) -> int:
        """Block references parked behind a fence (a shared block counts once per holder)."""
        return sum(len(blocks) for _, blocks in self.deferred_frees)

    @property
    def usage(self) -> float:
        """Fraction of blocks not on the free list (parked blocks count as used)."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def make_stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_deferred_blocks=self.num_deferred_blocks,
            usage=self.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate,
        )

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per KV cache group: here the one group."""
        return ([b.block_id for b in self.req_to_blocks[request_id]],)

    def block_ids_of(self, new_blocks: list[KVCacheBlock]) -> tuple[list[int], ...]:
        """What :meth:`allocate_slots` returned, as per-group block ids."""
        return ([b.block_id for b in new_blocks],)

    def num_live_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its KV bytes: times the bytes per block)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` positions holds at once."""
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; the last token is always recomputed."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_reserved_tokens: int = 0,
        fence_step_seq: int | None = None,
        publish: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more positions; None if the pool is too full.

        ``num_reserved_tokens`` asks that room for that many further tokens be free too
        (without taking it), so an admission does not start a prompt it cannot finish.
        ``fence_step_seq`` fences blocks the allocation releases: one full-attention group
        releases none (see HybridKVCacheManager). ``publish=False`` publishes no new block:
        a KV connector fills them later, and publishes them once it has.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_needed = max(num_needed, 0)
        # Touching a free cached block takes it off the free list too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        reserve = cdiv(total + num_reserved_tokens, self.block_size) - cdiv(total, self.block_size)
        if num_needed + num_evictable_hits + reserve > self.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        blocks.extend(new_blocks)
        if self.enable_caching and publish:
            # At schedule time the KV of every scheduled position is enqueued, so the
            # frontier is what will be computed, capped at the known ids.
            self.cache_blocks(request, min(total, request.num_tokens))
        return new_blocks

    def deferred_blocks_would_fit(self, request: Request, num_new_tokens: int) -> bool:
        """True when ``num_new_tokens`` more positions fit once the parked blocks are freed.

        The scheduler then waits for the fence instead of preempting a request.
        """
        if not self.deferred_frees:
            return False
        have = len(self.get_blocks(request.request_id))
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have
        return need <= self.num_free_blocks + self.num_deferred_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks below ``num_tokens``; monotone and idempotent."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.num_cached_block.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        if end <= start:
            return
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, start, end)
        self.num_cached_block[request.request_id] = end

    def remove_request(self, request: Request) -> list[KVCacheBlock]:
        """Detach the request's blocks, tail first (so the tail is evicted first)."""
        self.num_cached_block.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        return list(reversed(blocks))

    def free(self, request: Request, fence_step_seq: int | None = None) -> None:
        """Release the request's blocks: now, or once step ``fence_step_seq`` is processed."""
        self._release(self.remove_request(request), fence_step_seq)

    def _release(self, blocks: list[KVCacheBlock], fence_step_seq: int | None) -> None:
        """Free ``blocks`` now, or park them until step ``fence_step_seq`` is processed."""
        if not blocks:
            return
        if fence_step_seq is None:
            self.block_pool.free_blocks(blocks)
            return
        # Fences arrive in order, so free_deferred only ever looks at the front.
        assert not self.deferred_frees or self.deferred_frees[-1][0] <= fence_step_seq
        self.deferred_frees.append((fence_step_seq, blocks))

    def free_deferred(self, processed_step_seq: int) -> None:
        """Free the parked blocks of every fence at or below ``processed_step_seq``."""
        while self.deferred_frees and self.deferred_frees[0][0] <= processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            self.block_pool.free_blocks(blocks)
