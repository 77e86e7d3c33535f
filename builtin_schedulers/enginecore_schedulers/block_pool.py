"""The KV block pool: a fixed set of blocks, an O(1) free list and the prefix-cache map.

Block 0 is a reserved *null block* (never allocated, never cached), so ``num_blocks - 1``
blocks are usable. Freed blocks that carry a hash stay findable in the cache map until
they are popped for reuse (lazy eviction); only then is their hash cleared.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

BlockHash = bytes | int
# The prefix-cache map's key: a block's hash, or (group, hash) in a KV cache group after the
# first.
CacheKey = BlockHash | tuple[int, BlockHash]


class KVCacheBlock:
    """One KV block: its id, how many requests hold it, and its hash once full and cached."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: CacheKey | None = None
        # Intrusive links of the free list: removal from the middle is O(1).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks between two sentinels.

    The front is reused first. Eviction order is therefore: unhashed blocks (prepended
    on free), then cached blocks in the order they were freed (appended: LRU).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free:
            raise ValueError(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            block = block.next_free
        # Splice the whole run out at once.
        self._head.next_free = block
        assert block is not None
        block.prev_free = self._head
        for b in out:
            b.prev_free = b.next_free = None
        self.num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """Owns every block; hands out, takes back and caches them."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Block 0 never enters circulation: it pads block tables, and is never cached.
        self.null_block = self.free_queue.popleft()
        # One block per hash. A duplicate (same content computed twice) stays unhashed,
        # so it is reused first when freed rather than shadowing the cached one.
        self.cached_blocks: dict[CacheKey, KVCacheBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: CacheKey) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free list."""
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the front of the free list, evicting their cached hashes."""
        blocks = self.free_queue.popleft_n(n)
        cached = self.cached_blocks
        for block in blocks:
            h = block.block_hash
            if h is not None:
                # Lazy eviction: the block leaves the cache only now that it is reused.
                if cached.get(h) is block:
                    del cached[h]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def cache_block(self, block: KVCacheBlock, block_hash: CacheKey) -> bool:
        """Make a full block findable by its hash; False if another block already holds it."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass tail first).

        Blocks that reach zero go back to the free list: unhashed ones at the front (they
        hold nothing reusable), cached ones at the back (evicted last, LRU).
        """
        queue = self.free_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
            elif block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than allocated")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held by a request."""
        if self.free_queue.num_free != self.num_blocks - 1:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def leak_report(self) -> list[str]:
        """Problems that mean blocks leaked; empty when every block is free (or free and cached)."""
        problems = []
        if self.free_queue.num_free != self.num_blocks - 1:
            problems.append(
                f"{self.num_blocks - 1 - self.free_queue.num_free} of "
                f"{self.num_blocks - 1} usable blocks are not free"
            )
        held = [b.block_id for b in self.blocks[1:] if b.ref_cnt != 0]
        if held:
            problems.append(f"blocks with ref_cnt != 0: {held[:20]}")
        if self.null_block.ref_cnt != 0 or self.null_block.block_hash is not None:
            problems.append("the null block was used")
        return problems
