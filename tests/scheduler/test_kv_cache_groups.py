"""KV cache groups: sliding-window layers keep only their window's blocks (no model)."""

from __future__ import annotations

import pytest

from enginecore.request import Request
from enginecore_schedulers.kv_cache_manager import KVCacheManager
from tests.helpers.scheduler import (  # leak_check: autouse, no block left held after a test
    create_scheduler,
    leak_check,  # noqa: F401
    make_output,
    make_request,
    run_async,
    run_to_completion,
)

BS = 4
WINDOW = 8
WINDOW_BLOCKS = -(-WINDOW // BS) + 1  # what a sliding group may hold at most


def _prefill(kv: KVCacheManager, request: Request, chunk: int) -> None:
    hits, num_hit = kv.get_computed_blocks(request)
    request.num_computed_tokens = 0
    first = True
    while request.num_computed_tokens + (num_hit if first else 0) < request.num_tokens:
        done = request.num_computed_tokens + (num_hit if first else 0)
        n = min(chunk, request.num_tokens - done)
        if first:
            assert kv.allocate_slots(request, n, num_hit, hits) is not None
            request.num_computed_tokens = num_hit + n
            first = False
        else:
            assert kv.allocate_slots(request, n) is not None
            request.num_computed_tokens += n


def _decode(kv: KVCacheManager, request: Request, steps: int, check) -> None:
    for i in range(steps):
        request.output_token_ids.append(7000 + i)
        request.all_token_ids.append(7000 + i)
        assert kv.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        check()


def test_sliding_only_request_holds_its_window() -> None:
    kv = KVCacheManager(64, BS, max_model_len=1024, kv_cache_groups=[WINDOW])
    request = make_request("a", list(range(100, 160)), max_tokens=100)  # 60 tokens >> W
    _prefill(kv, request, chunk=12)
    # The last chunk (positions 48..59) and the window of its first token: blocks 10..14.
    assert kv.num_held_blocks("a") == [5]
    usable = kv.block_pool.num_usable_blocks

    def check() -> None:
        (held,) = kv.num_held_blocks("a")
        assert held <= WINDOW_BLOCKS
        assert kv.get_num_free_blocks() == usable - held
        assert kv.usage == pytest.approx(held / usable)  # the kv_cache_usage metric

    _decode(kv, request, 40, check)
    ids = kv.get_block_ids("a")
    assert len(ids) == -(-request.num_tokens // BS)  # one entry per block position
    assert ids[: len(ids) - WINDOW_BLOCKS].count(0) == len(ids) - WINDOW_BLOCKS
    kv.free(request)
    assert kv.leak_report() == []


def test_alternating_groups_full_keeps_all_sliding_keeps_window() -> None:
    kv = KVCacheManager(128, BS, max_model_len=1024, kv_cache_groups=[None, WINDOW])
    request = make_request("a", list(range(100, 150)), max_tokens=100)
    _prefill(kv, request, chunk=16)

    def check() -> None:
        full, sliding = kv.num_held_blocks("a")
        assert full == -(-request.num_computed_tokens // BS)
        assert sliding <= WINDOW_BLOCKS

    check()
    _decode(kv, request, 30, check)
    full_ids, sliding_ids = kv.get_group_block_ids("a")
    assert 0 not in full_ids
    assert not set(full_ids) & {b for b in sliding_ids if b}  # one pool, no sharing
    kv.free(request)
    assert kv.leak_report() == []


def test_prefix_hit_needs_only_the_window_of_a_sliding_group() -> None:
    kv = KVCacheManager(128, BS, max_model_len=1024, kv_cache_groups=[None, WINDOW])
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks
    first = make_request("a", prompt, max_tokens=4)
    _prefill(kv, first, chunk=8)
    kv.free(first)
    second = make_request("b", [*prompt, 5, 6, 7], max_tokens=4)
    (full, sliding), num_hit = kv.get_computed_blocks(second)
    assert num_hit == 40
    assert [b.block_id for b in full] == kv_block_ids_of(kv, prompt, group=0)
    # Position 40 sees positions 33..40: blocks 8 and 9 only; the rest are the null block.
    assert [b.block_id for b in sliding[:8]] == [0] * 8
    assert all(b.block_id != 0 for b in sliding[8:])
    assert kv.allocate_slots(second, 4, num_hit, [full, sliding]) is not None
    assert kv.num_held_blocks("b") == [11, 3]
    kv.free(second)
    assert kv.leak_report() == []


def kv_block_ids_of(kv: KVCacheManager, prompt: list[int], group: int) -> list[int]:
    probe = make_request("probe", [*prompt, 1], max_tokens=1)
    hashes = kv.hasher.update(probe)
    return [kv.block_pool.cached_blocks[kv._cache_key(group, h)].block_id for h in hashes[:10]]


def test_evicted_window_block_shortens_the_hit() -> None:
    """A sliding group's hit needs its window blocks cached; a missing one shortens it."""
    kv = KVCacheManager(128, BS, max_model_len=1024, kv_cache_groups=[None, WINDOW])
    prompt = list(range(100, 141))
    first = make_request("a", prompt, max_tokens=4)
    _prefill(kv, first, chunk=8)
    kv.free(first)
    # Drop the sliding group's block 9 from the cache: a hit of 10 blocks cannot be
    # served; 9 blocks needs blocks 7 and 8 of it (still cached).
    probe = make_request("probe", prompt, max_tokens=1)
    block_hash = kv._cache_key(1, kv.hasher.update(probe)[9])
    kv.uncache_blocks({kv.block_pool.cached_blocks[block_hash].block_id})
    second = make_request("b", [*prompt, 5], max_tokens=4)
    (full, sliding), num_hit = kv.get_computed_blocks(second)
    assert num_hit == 36
    assert len(full) == len(sliding) == 9


@pytest.mark.parametrize(
    ("groups", "blocks_per_memory"),
    # A Gemma-2-style model's blocks hold half its layers each (sliding layer i and full
    # layer i share cache tensor i): the same memory gives twice the blocks.
    [([16], 1), ([None, 16], 2)],
)
def test_more_long_requests_fit_in_a_fixed_budget(
    groups: list[int | None], blocks_per_memory: int
) -> None:
    """Eight 200-token requests, 64 blocks of 16 tokens: keeping every position, at most
    4 can hold their 13 blocks at once, so the rest are preempted; keeping only the sliding
    window, all 8 run together from admission to the end."""
    results = {}
    for name, kv_groups, num_blocks in (
        ("all positions", None, 64),
        ("window", groups, 64 * blocks_per_memory),
    ):
        scheduler = create_scheduler(
            num_blocks=num_blocks + 1,
            block_size=16,
            max_num_batched_tokens=1024,
            max_model_len=512,
            kv_cache_groups=kv_groups,
        )
        for i in range(8):
            scheduler.add_request(
                make_request(str(i), [i + 1] * 100, max_tokens=100, seq_no=i, ignore_eos=True)
            )
        running_counts, preemptions = [], 0
        while scheduler.get_num_unfinished_requests() == 8:
            out = scheduler.schedule()
            running_counts.append(len(scheduler.running))
            scheduler.update_from_output(out, make_output(scheduler, out))
            preemptions += scheduler.make_stats().num_preemptions
        run_to_completion(scheduler)
        results[name] = (min(running_counts), preemptions)
    fewest, preemptions = results["all positions"]
    assert fewest <= 4 and preemptions > 0
    assert results["window"] == (8, 0)


def test_sliding_only_prefix_hit_takes_only_the_window() -> None:
    kv = KVCacheManager(64, BS, max_model_len=1024, kv_cache_groups=[WINDOW])
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks
    first = make_request("a", prompt, max_tokens=4)
    _prefill(kv, first, chunk=8)
    kv.free(first)
    second = make_request("b", [*prompt, 5], max_tokens=4)
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 40
    assert [b.block_id for b in hits[:8]] == [0] * 8
    assert kv.allocate_slots(second, 2, num_hit, hits) is not None
    assert kv.num_held_blocks("b") == [3]
    kv.free(second)
    assert kv.leak_report() == []


@pytest.mark.parametrize(
    ("groups", "num_blocks"), [([16], 16), ([None, 16], 40), ([None, 16, 16], 48)]
)
def test_async_preempted_prefix_cached_groups_leave_no_blocks(groups, num_blocks) -> None:
    """Async steps (two in flight), a shared prefix and a budget that forces preemption:
    every request finishes with its tokens, prefix hits happen, and no block leaks
    (checked after the test by the helpers' leak check)."""
    scheduler = create_scheduler(
        num_blocks=num_blocks,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=512,
        prefix_caching=True,
        kv_cache_groups=groups,
    )
    shared = list(range(1000, 1064))
    for i in range(8):
        prompt = [*shared, *range(i * 100, i * 100 + 40)]
        scheduler.add_request(
            make_request(str(i), prompt, max_tokens=120, seq_no=i, ignore_eos=True)
        )
    finished, preemptions, hits = set(), 0, 0
    for out, engine_outputs in run_async(scheduler):
        preemptions += len(out.preempted_req_ids)
        for outs in engine_outputs.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    finished.add(o.request_id)
        stats = scheduler.make_stats()
        hits += stats.prefix_cache_hits
    assert finished == {str(i) for i in range(8)}
    assert preemptions > 0 and hits > 0
