"""The per-group policies of the hybrid KV cache manager: full attention and sliding window.

Each policy works on one request's block list of its group; the coordinator
(``HybridKVCacheManager``) owns the lists, the pool and the fence. A block list always has
one entry per block of the sequence so far; a sliding group's entries that no query can
see any more hold the shared null block.
"""

from __future__ import annotations

from forerun.core.block_pool import BlockPool, KVCacheBlock
from forerun.core.kv_cache_spec import KVCacheGroupSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Full attention: every block of the sequence stays, a hit is the cached prefix."""

    def __init__(self, group_id: int, group: KVCacheGroupSpec, block_size: int,
                 null_block: KVCacheBlock) -> None:
        self.group_id = group_id
        self.group = group
        self.block_size = block_size
        self.null_block = null_block
        # The group id is part of a block's prefix-cache key: the groups hash the same
        # token chain but hold different KV (different layers) in different blocks.
        self._key_suffix = group_id.to_bytes(2, "little")

    def cache_key(self, block_hash: bytes) -> bytes:
        return block_hash + self._key_suffix

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock],
                              num_computed_tokens: int) -> list[KVCacheBlock]:
        """Replace the blocks no query from ``num_computed_tokens`` on can see by the null
        block; return them (oldest first). Full attention sees everything: none."""
        return []

    def first_visible_block(self, num_computed_tokens: int) -> int:
        """Index of the first block a query at ``num_computed_tokens`` or later can see."""
        return 0

    def max_live_blocks(self, num_tokens: int, max_chunk: int) -> int:
        """The most real blocks one request of ``num_tokens`` positions holds in this group
        while computed in steps of at most ``max_chunk`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_reserve_blocks(self, total: int, num_reserved_tokens: int,
                           num_new_tokens: int) -> int:
        """Blocks to keep free for ``num_reserved_tokens`` more positions after ``total``."""
        bs = self.block_size
        return cdiv(total + num_reserved_tokens, bs) - cdiv(total, bs)

    def find_longest_cache_hit(self, pool: BlockPool, block_hashes: list[bytes],
                               max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` blocks: the cached prefix."""
        hits: list[KVCacheBlock] = []
        cached = pool.cached_block_hash_to_block
        suffix = self._key_suffix
        for h in block_hashes[:max_blocks]:
            entry = cached.get(h + suffix)
            if not entry:
                break
            hits.append(next(iter(entry.values())))
        return hits


FullAttentionManager = SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window W: a query at position p sees [p - W + 1, p], so blocks wholly before
    the step's first query minus W - 1 are released, and a hit needs only the blocks of the
    W - 1 positions before its end."""

    def __init__(self, group_id: int, group: KVCacheGroupSpec, block_size: int,
                 null_block: KVCacheBlock) -> None:
        super().__init__(group_id, group, block_size, null_block)
        window = group.spec.sliding_window
        assert window is not None
        self.window = window
        # Blocks a hit must end with: they hold the W - 1 positions before its end.
        self.num_tail_blocks = cdiv(window - 1, block_size)

    def first_visible_block(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock],
                              num_computed_tokens: int) -> list[KVCacheBlock]:
        n = min(self.first_visible_block(num_computed_tokens), len(blocks))
        null = self.null_block
        removed: list[KVCacheBlock] = []
        # From the newest skipped block back to the first null one: each step looks only
        # at the blocks it newly skips.
        for i in range(n - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            removed.append(block)
            blocks[i] = null
        removed.reverse()
        return removed

    def max_live_blocks(self, num_tokens: int, max_chunk: int) -> int:
        # A step of n tokens at C reads [C - W + 1, C + n): W - 1 + n positions, one block
        # more than their count when they start late in a block.
        bs = self.block_size
        live = cdiv(self.window - 1 + min(max_chunk, num_tokens), bs) + 1
        return min(cdiv(num_tokens, bs), live)

    def num_reserve_blocks(self, total: int, num_reserved_tokens: int,
                           num_new_tokens: int) -> int:
        # The rest of a prompt comes in chunks no larger than this one, and the window frees
        # about as many blocks as each chunk takes: keep room for the window grown to one
        # more such chunk, never more than a full group would keep.
        bs = self.block_size
        full = cdiv(total + num_reserved_tokens, bs) - cdiv(total, bs)
        if full == 0:
            return 0
        live_now = cdiv(total, bs) - self.first_visible_block(total - num_new_tokens)
        peak = self.max_live_blocks(total + num_reserved_tokens, num_new_tokens)
        return min(full, max(0, peak - live_now))

    def find_longest_cache_hit(self, pool: BlockPool, block_hashes: list[bytes],
                               max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` blocks whose last ``num_tail_blocks``
        are cached (fewer if the run reaches block 0): scanned from the right."""
        null = self.null_block
        need = self.num_tail_blocks
        if need == 0:
            return [null] * max_blocks
        cached = pool.cached_block_hash_to_block
        suffix = self._key_suffix
        run: list[KVCacheBlock] = []  # cached blocks, newest first
        for i in range(max_blocks - 1, -1, -1):
            entry = cached.get(block_hashes[i] + suffix)
            if not entry:
                run.clear()
                continue
            run.append(next(iter(entry.values())))
            if len(run) == need:
                run.reverse()
                return [null] * i + run
        run.reverse()
        return run  # a contiguous run from block 0 (or nothing)


def make_single_type_manager(group_id: int, group: KVCacheGroupSpec, block_size: int,
                             null_block: KVCacheBlock) -> SingleTypeKVCacheManager:
    cls = SlidingWindowManager if group.spec.is_sliding else FullAttentionManager
    return cls(group_id, group, block_size, null_block)
