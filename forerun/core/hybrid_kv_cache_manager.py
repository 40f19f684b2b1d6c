"""The KV cache manager of a model with several KV cache groups (full + sliding window).

Same interface as :class:`KVCacheManager` (which stays the one-group fast path), with one
block list per group per request. Block ids leave it as per-group tuples.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from forerun.core.block_pool import KVCacheBlock
from forerun.core.kv_cache_manager import KVCacheManager, cdiv
from forerun.core.kv_cache_spec import KVCacheGroupSpec
from forerun.core.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    make_single_type_manager,
)
from forerun.request import Request

logger = logging.getLogger(__name__)

GroupBlocks = tuple[list[KVCacheBlock], ...]


class HybridKVCacheManager(KVCacheManager):
    """Per-group block tables over one shared pool (vLLM's hybrid allocator).

    - A sliding group releases the blocks no future query can see (wholly before the
      step's first position minus W - 1) when the request is next scheduled; its table
      keeps the shared null block (pool block 0, never freed) in their place. The release
      is fenced like a free: parked until every step in flight that may read or write the
      blocks has been processed (the caller passes the fence).
    - Prefix caching: every group publishes its full blocks under the request's chain
      hashes keyed by group id. A hit of L tokens needs the full groups' blocks below L and
      each sliding group's blocks of [L - W + 1, L); the groups are iterated to a fixed
      point. Released blocks that carry a hash stay in the pool's LRU for later hits.
    - ``num_blocks`` counts usable blocks (the pool less the null block).
    """

    releases_blocks_while_running = True

    def __init__(self, groups: Sequence[KVCacheGroupSpec], num_blocks: int, block_size: int,
                 enable_caching: bool = True) -> None:
        if len(groups) < 2:
            raise ValueError("one KV cache group: use KVCacheManager")
        # One more block than asked for: the null block.
        super().__init__(num_blocks + 1, block_size, enable_caching)
        self.null_block = self.block_pool.get_new_blocks(1)[0]
        self.kv_cache_groups = list(groups)
        self.managers: list[SingleTypeKVCacheManager] = [
            make_single_type_manager(gid, g, block_size, self.null_block)
            for gid, g in enumerate(groups)
        ]
        self._sliding = [m for m in self.managers if m.group.spec.is_sliding]
        self.group_req_to_blocks: dict[str, GroupBlocks] = {}

    # ----- accounting ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def get_group_blocks(self, request_id: str) -> GroupBlocks:
        return self.group_req_to_blocks.get(request_id, ())

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's real blocks, every group (no null placeholders)."""
        null = self.null_block
        return [b for blocks in self.get_group_blocks(request_id) for b in blocks
                if b is not null]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.get_blocks(request_id)]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks]
                     for blocks in self.group_req_to_blocks[request_id])

    def block_ids_of(self, new_blocks: GroupBlocks) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def num_live_blocks(self, request_id: str) -> int:
        """Real blocks the request holds now (what its KV costs: times kv_bytes_per_block)."""
        return len(self.get_blocks(request_id))

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int) -> int:
        return sum(m.max_live_blocks(num_tokens, max_chunk) for m in self.managers)

    # ----- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:  # type: ignore[override]
        """Longest cache hit every group can serve; ((), 0) on a miss."""
        if not self.enable_caching:
            return (), 0
        self.prefix_cache_queries += request.num_tokens
        num_hit = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        # Each group can only shorten the hit; a sliding group's hit at a shorter length
        # is a different set of blocks, so go round until no group shortens it.
        changed = True
        while changed and num_hit > 0:
            changed = False
            for gid, manager in enumerate(self.managers):
                if len(hits[gid]) == num_hit:
                    continue
                found = manager.find_longest_cache_hit(self.block_pool, hashes, num_hit)
                hits[gid] = found
                if len(found) < num_hit:
                    num_hit = len(found)
                    changed = True
        if num_hit == 0:
            return (), 0
        self.prefix_cache_hits += num_hit * self.block_size
        return tuple(hits), num_hit * self.block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        group_blocks = self.group_req_to_blocks.get(rid)
        if not group_blocks:
            return
        start = self.num_cached_block.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes),
                  len(group_blocks[0]))
        if end <= start:
            return
        hashes = request.block_hashes
        pool, null = self.block_pool, self.null_block
        for manager, blocks in zip(self.managers, group_blocks, strict=True):
            for i in range(start, end):
                block = blocks[i]
                # A released block was never published (or already was); a hit is.
                if block is not null and block.block_hash is None:
                    pool.cache_block(block, manager.cache_key(hashes[i]))
        self.num_cached_block[rid] = end

    # ----- allocation -----------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int,
                              fence_step_seq: int | None) -> None:
        """Release every sliding group's blocks no query from ``num_computed_tokens`` on
        sees; ``fence_step_seq`` is the newest step in flight that may still touch them."""
        group_blocks = self.group_req_to_blocks.get(request_id)
        if group_blocks is None:
            return
        for manager in self._sliding:
            removed = manager.remove_skipped_blocks(group_blocks[manager.group_id],
                                                    num_computed_tokens)
            self._release(removed, fence_step_seq)

    def allocate_slots(  # type: ignore[override]
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | Sequence[KVCacheBlock] | None = None,
        num_reserved_tokens: int = 0,
        fence_step_seq: int | None = None,
    ) -> GroupBlocks | None:
        """Per group, make room for ``num_new_tokens`` more positions (see the base class);
        first releases what the sliding groups no longer see, behind ``fence_step_seq``."""
        rid = request.request_id
        group_blocks = self.group_req_to_blocks.get(rid)
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_new_tokens
        num_total_blocks = cdiv(total, self.block_size)
        if group_blocks is not None:
            self.remove_skipped_blocks(rid, computed, fence_step_seq)
            if (not new_computed_blocks and not num_reserved_tokens
                    and num_total_blocks <= len(group_blocks[0])):
                # Most decode steps: room in the last blocks (every group's table has the
                # same length).
                if self.enable_caching:
                    self.cache_blocks(request, min(total, request.num_tokens))
                return tuple([] for _ in group_blocks)
        hits = new_computed_blocks or ()
        need: list[int] = []
        num_evictable_hits = reserve = 0
        for gid, manager in enumerate(self.managers):
            have = len(group_blocks[gid]) if group_blocks is not None else 0
            group_hits = hits[gid] if hits else ()
            need.append(max(num_total_blocks - have - len(group_hits), 0))
            # Touching a free cached block takes it off the free list (null has ref 1).
            num_evictable_hits += sum(1 for b in group_hits if b.ref_cnt == 0)
            if num_reserved_tokens:
                reserve += manager.num_reserve_blocks(total, num_reserved_tokens,
                                                      num_new_tokens)
        if sum(need) + num_evictable_hits + reserve > self.num_free_blocks:
            return None
        if group_blocks is None:
            group_blocks = tuple([] for _ in self.managers)
            self.group_req_to_blocks[rid] = group_blocks
        null = self.null_block
        for gid, group_hits in enumerate(hits):
            self.block_pool.touch(b for b in group_hits if b is not null)
            group_blocks[gid].extend(group_hits)
        new_blocks = tuple(self.block_pool.get_new_blocks(n) for n in need)
        for blocks, new in zip(group_blocks, new_blocks, strict=True):
            blocks.extend(new)
        if self.enable_caching:
            self.cache_blocks(request, min(total, request.num_tokens))
        return new_blocks

    def deferred_blocks_would_fit(self, request: Request, num_new_tokens: int) -> bool:
        if not self.deferred_frees:
            return False
        group_blocks = self.get_group_blocks(request.request_id)
        total_blocks = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        need = sum(max(total_blocks - len(blocks), 0) for blocks in group_blocks)
        if not group_blocks:
            need = total_blocks * self.num_groups
        return need <= self.num_free_blocks + self.num_deferred_blocks

    def remove_request(self, request: Request) -> list[KVCacheBlock]:
        """Detach the request's real blocks, tails first (so the tails are evicted first)."""
        self.num_cached_block.pop(request.request_id, None)
        group_blocks = self.group_req_to_blocks.pop(request.request_id, ())
        null = self.null_block
        return [b for blocks in group_blocks for b in reversed(blocks) if b is not null]


def make_kv_cache_manager(groups: Sequence[KVCacheGroupSpec], num_blocks: int, block_size: int,
                          enable_caching: bool = True) -> KVCacheManager:
    """The one-group manager (every model without sliding layers) or the hybrid one."""
    if len(groups) == 1:
        return KVCacheManager(num_blocks, block_size, enable_caching)
    logger.info("hybrid KV cache: %s", ", ".join(
        f"{g.spec.attention_type}/{g.spec.sliding_window} x{len(g.layer_indices)}"
        for g in groups))
    return HybridKVCacheManager(groups, num_blocks, block_size, enable_caching)
