"""The KV block pool: null block, O(1) free list, LRU order, lazy eviction."""

from __future__ import annotations

import pytest

from enginecore_schedulers.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_block_zero_is_reserved_null_block():
    pool = BlockPool(num_blocks=5)
    assert pool.null_block.block_id == 0
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert ids(got) == [1, 2, 3, 4]  # allocation pops from the front, in id order
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(reversed(got))
    assert pool.leak_report() == []


def test_pool_needs_at_least_two_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1)


def test_free_queue_is_a_doubly_linked_list():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 6
    queue.remove(blocks[3])  # from the middle
    assert ids(queue) == [0, 1, 2, 4, 5]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    assert queue.popleft() is blocks[0]
    queue.appendleft(blocks[3])
    queue.append(blocks[0])
    assert ids(queue) == [3, 1, 2, 4, 5, 0]
    assert ids(queue.popleft_n(3)) == [3, 1, 2]
    assert ids(queue) == [4, 5, 0]
    assert queue.num_free == 3
    with pytest.raises(ValueError):
        queue.remove(blocks[1])  # not in the list any more
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    queue.popleft_n(3)
    with pytest.raises(ValueError):
        queue.popleft()


def test_freed_unhashed_blocks_are_reused_first_and_hashed_ones_last():
    pool = BlockPool(num_blocks=7)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.cache_block(a[0], b"h1")
    pool.cache_block(a[1], b"h2")
    pool.free_blocks(reversed(a))  # tail first: 3 (unhashed), 2, 1 (hashed)
    # Unhashed block 3 goes to the front; cached 2 then 1 to the back (LRU: chain
    # tails are evicted before heads).
    assert ids(pool.free_queue) == [3, 4, 5, 6, 2, 1]


def test_cached_free_block_stays_findable_until_reused():
    pool = BlockPool(num_blocks=3)
    [block] = pool.get_new_blocks(1)
    assert pool.cache_block(block, b"h")
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert pool.get_cached_block(b"h") is block  # lazy eviction: still a hit
    # A hit on a free cached block pulls it out of the middle of the free list.
    pool.touch([block])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_queue)
    pool.free_blocks([block])
    # Reuse evicts: the hash is cleared and the map forgets it.
    got = pool.get_new_blocks(2)
    assert block in got
    assert block.block_hash is None
    assert pool.get_cached_block(b"h") is None
    pool.free_blocks(got)


def test_duplicate_hash_is_not_cached_twice():
    pool = BlockPool(num_blocks=4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"same")
    assert not pool.cache_block(b, b"same")
    assert b.block_hash is None
    assert pool.get_cached_block(b"same") is a
    pool.free_blocks([b, a])


def test_touch_shared_block_only_counts_references():
    pool = BlockPool(num_blocks=4)
    [block] = pool.get_new_blocks(1)
    pool.cache_block(block, 7)
    free_before = pool.get_num_free_blocks()
    pool.touch([block])
    assert block.ref_cnt == 2
    assert pool.get_num_free_blocks() == free_before
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.get_num_free_blocks() == free_before
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == free_before + 1


def test_double_free_is_an_error():
    pool = BlockPool(num_blocks=3)
    [block] = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_reset_prefix_cache_refused_while_blocks_are_held():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], b"x")
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.cached_blocks == {}
    assert all(b.block_hash is None for b in pool.blocks)


def test_usage_and_leak_report():
    pool = BlockPool(num_blocks=5)
    assert pool.usage == 0.0
    got = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    problems = pool.leak_report()
    assert problems and "not free" in problems[0]
    pool.free_blocks(got)
    assert pool.usage == 0.0
    assert pool.leak_report() == []
