"""The pool of KV blocks: reference counts, an O(1) free list and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One block of KV slots. Links are intrusive so that the free list allocates nothing."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; the front is reused first.

    Removing a block from the middle is O(1), which a prefix-cache hit on a free (but still
    cached) block needs.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        assert self._tail.prev_free is not None
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def __iter__(self):
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every KV block.

    A freed block that carries a hash stays findable in the prefix cache until it is
    handed out again (LRU: cached blocks go to the back of the free list, uncached ones to
    the front, so uncached blocks are reused first).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        entry = self.cached_block_hash_to_block.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks, only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        entry = self.cached_block_hash_to_block.get(h)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached_block_hash_to_block[h]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones off the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          start: int, end: int) -> None:
        """Publish ``blocks[start:end]`` under their chain hashes."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a prefix hit, already published
            h = block_hashes[i]
            block.block_hash = h
            self.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Publish one block under ``block_hash`` (the hybrid manager's per-group keys)."""
        if not self.enable_caching:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; the first block given is the first to be evicted."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)
