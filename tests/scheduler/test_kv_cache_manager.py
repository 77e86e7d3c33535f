"""KV cache manager: allocation, prefix caching, hashing (reference statements 22-32)."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import msgspec
import pytest

from enginecore import SamplingParams
from enginecore.request import Request
from enginecore_schedulers.block_hash import (
    NONE_HASH_SHA256,
    BlockHasher,
    builtin_block_hash,
    sha256_block_hash,
)
from enginecore_schedulers.kv_cache_manager import KVCacheManager
from tests.helpers.scheduler import make_request

BS = 4  # small blocks keep the arithmetic readable


def manager(num_blocks: int = 11, caching: bool = True, algo: str = "sha256") -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, max_model_len=1024, enable_caching=caching, hash_algo=algo
    )


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None):
    """Look up the prefix cache and allocate the rest of the prompt, like admission does."""
    hits, num_hit = kv.get_computed_blocks(request)
    n = request.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(request, n, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = num_hit + n
    return hits, num_hit


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# --- 22: hashing -------------------------------------------------------------------


def test_only_full_blocks_are_hashed_and_chained():
    kv = manager()
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    admit(kv, req)
    assert len(req.block_hashes) == 2
    blocks = kv.get_blocks("a")
    assert len(blocks) == 3
    assert blocks[0].block_hash == req.block_hashes[0]
    assert blocks[1].block_hash == req.block_hashes[1]
    assert blocks[2].block_hash is None  # partial tail block: no hash
    h0 = sha256_block_hash(None, [0, 1, 2, 3])
    assert req.block_hashes == [h0, sha256_block_hash(h0, [4, 5, 6, 7])]
    # Same block tokens after a different prefix: different hash (chained).
    other = make_request("b", [9, 9, 9, 9, 4, 5, 6, 7])
    BlockHasher(BS).update(other)
    assert other.block_hashes[1] != req.block_hashes[1]
    kv.free(req)


def test_sha256_encoding_is_fixed_and_stable_across_processes():
    h = sha256_block_hash(None, [1, 2, 3, 4], "salt")
    expected = hashlib.sha256(NONE_HASH_SHA256)
    expected.update(struct.pack("<I4q", 4, 1, 2, 3, 4))
    expected.update(b"\x01" + struct.pack("<I", 4) + b"salt")
    assert h == expected.digest()
    code = (
        "from enginecore_schedulers.block_hash import sha256_block_hash as f;"
        "print(f(None, [1, 2, 3, 4], 'salt').hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert other.stdout.strip() == h.hex()


def test_builtin_hash_algo_gives_int_hashes_and_prefix_hits():
    kv = manager(algo="builtin")
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert all(isinstance(h, int) for h in a.block_hashes)
    assert a.block_hashes[0] == builtin_block_hash(None, [0, 1, 2, 3])
    b = make_request("b", list(range(9)))
    _, num_hit = admit(kv, b)
    assert num_hit == 8
    kv.free(a)
    kv.free(b)


def test_unknown_hash_algo_is_rejected():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        manager(algo="md5")


def test_hashes_are_computed_incrementally(monkeypatch):
    kv = manager()
    calls = []
    real = kv.hasher.hash_fn
    kv.hasher.hash_fn = lambda *a: calls.append(a[1]) or real(*a)
    req = make_request("a", list(range(8)))
    admit(kv, req)
    assert len(calls) == 2
    # Decode 6 tokens one at a time: only the one newly completed block is hashed.
    for t in range(6):
        req.append_output_token_ids([100 + t])
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    assert len(calls) == 3
    assert list(calls[-1]) == [100, 101, 102, 103]
    kv.free(req)


# --- 23-26: prefix hits --------------------------------------------------------------


def test_shared_prefix_reuses_the_same_blocks():
    kv = manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", [*range(8), 50, 51, 52])  # same first two blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert ids(hits) == ids(kv.get_blocks("a")[:2])
    assert kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is not None
    assert all(blk.ref_cnt == 2 for blk in hits)
    assert ids(kv.get_blocks("b"))[:2] == ids(kv.get_blocks("a"))[:2]
    # Freed requests' blocks remain hits (lazy eviction).
    kv.free(a)
    kv.free(b)
    c = make_request("c", [*range(8), 77])
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8 and all(blk.ref_cnt == 0 for blk in hits)


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    # Capped at num_tokens - 1 = 7 tokens -> one whole block (allocation is block-aligned).
    assert num_hit == 4 and len(hits) == 1
    kv.free(a)


def test_caching_disabled_never_hits():
    kv = manager(caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert all(b.block_hash is None for b in kv.get_blocks("a"))
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)


def test_cache_salt_keys_the_first_block_and_the_chain():
    kv = manager()
    a = make_request("a", list(range(9)), cache_salt="alice")
    admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), cache_salt="alice"))[1] == 8
    kv.free(a)


class _PromptLogprobsParams(SamplingParams, kw_only=True):
    """SamplingParams as a frontend asking for prompt logprobs would extend it."""

    prompt_logprobs: int | None = None


def test_prompt_logprobs_skip_the_lookup_but_populate_the_cache():
    kv = manager()
    params = _PromptLogprobsParams(max_tokens=4, prompt_logprobs=1)
    assert msgspec.structs.asdict(params)["prompt_logprobs"] == 1
    a = Request("a", list(range(9)), params)
    assert kv.get_computed_blocks(a) == ([], 0)
    admit(kv, a)
    b = make_request("b", list(range(9)))
    assert kv.get_computed_blocks(b)[1] == 8  # a populated the cache
    c = Request("c", list(range(9)), params)
    assert kv.get_computed_blocks(c) == ([], 0)  # but never reads it
    kv.free(a)


# --- 29-31: eviction, decode, failed allocation --------------------------------------


def test_eviction_is_lru_and_reused_blocks_lose_their_hash():
    kv = manager(num_blocks=4)  # 3 usable blocks
    a = make_request("a", [0, 1, 2, 3, 99])  # block 1 full+cached, block 2 partial
    admit(kv, a)
    b = make_request("b", [7, 7, 7, 7, 98])
    kv.free(a)
    admit(kv, b)  # takes the free non-cached blocks first: a's partial block and block 3
    kv.free(b)
    [a_block] = [blk for blk in kv.block_pool.blocks if blk.block_hash == a.block_hashes[0]]
    [b_block] = [blk for blk in kv.block_pool.blocks if blk.block_hash == b.block_hashes[0]]
    # c hits a's block; it needs two more blocks: the unhashed one, then the LRU cached
    # one -- b's (freed after a's, but a's is the hit, so it is not evicted).
    c = make_request("c", [0, 1, 2, 3, 1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(c)
    assert ids(hits) == [a_block.block_id]
    assert kv.allocate_slots(c, c.num_tokens - num_hit, num_hit, hits) is not None
    assert a_block.block_hash == a.block_hashes[0]
    assert b_block in kv.get_blocks("c")
    assert kv.block_pool.get_cached_block(b.block_hashes[0]) is None
    # Reused for c's partial tail: b's old hash is gone. c's full second block is cached.
    assert kv.get_blocks("c")[2] is b_block
    assert b_block.block_hash is None
    assert kv.get_blocks("c")[1].block_hash == c.block_hashes[1]
    kv.free(c)


def test_decode_allocates_only_when_crossing_a_block_boundary():
    kv = manager()
    req = make_request("a", list(range(6)))
    admit(kv, req)
    assert len(kv.get_blocks("a")) == 2
    for tok in (10, 11):  # 7 then 8 tokens still fit in two blocks
        req.append_output_token_ids([tok])
        assert kv.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    assert len(kv.get_blocks("a")) == 2
    # Token 9 crosses into a third block; the now-full second block gets its hash.
    req.append_output_token_ids([12])
    new = kv.allocate_slots(req, 1)
    req.num_computed_tokens += 1
    assert new is not None and len(new) == 1
    assert kv.get_blocks("a")[1].block_hash == req.block_hashes[1]
    kv.free(req)


def test_failed_allocation_has_no_side_effects():
    kv = manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(8)))
    admit(kv, a)
    filler = make_request("f", [5] * 8)
    admit(kv, filler)
    assert kv.get_num_free_blocks() == 0
    b = make_request("b", [*range(8), 1, 2, 3, 4, 5])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = [blk.ref_cnt for blk in hits]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is None
    assert [blk.ref_cnt for blk in hits] == before
    assert not kv.has_request("b")
    assert kv.get_block_ids("b") == []
    kv.free(a)
    kv.free(filler)
    assert kv.leak_report() == []


def test_free_hit_blocks_count_against_free_space():
    kv = manager(num_blocks=4)  # 3 usable
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # both blocks free but cached
    b = make_request("b", [*range(8), 1, 2, 3, 4, 5])  # 2 hit + 2 new blocks > 3 free
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 5, num_hit, hits) is None
    assert all(blk.ref_cnt == 0 for blk in hits)
    assert kv.get_num_free_blocks() == 3


def test_lookahead_slots_are_allocated_but_never_cached():
    kv = manager()
    req = make_request("a", list(range(4)))
    new = kv.allocate_slots(req, 4, num_lookahead_tokens=5)
    assert new is not None and len(new) == 3
    assert [b.block_hash is not None for b in new] == [True, False, False]
    kv.free(req)


# --- 32, stats, free order -------------------------------------------------------------


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    kv = manager()
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("x", list(range(9))))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    assert kv.get_computed_blocks(make_request("y", list(range(9))))[1] == 0


def test_free_returns_blocks_tail_first():
    kv = manager(num_blocks=6)
    a = make_request("a", list(range(13)))  # 3 full blocks + 1 partial
    admit(kv, a)
    blocks = kv.get_blocks("a")
    kv.free(a)
    order = ids(kv.block_pool.free_queue)
    assert order[0] == blocks[3].block_id  # partial block prepended: reused first
    assert order[-3:] == [blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]
    assert kv.get_block_ids("a") == []


def test_usage_and_prefix_cache_stats():
    kv = manager(num_blocks=11)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    assert kv.usage == pytest.approx(0.2)
    b = make_request("b", [*range(8), 1])
    admit(kv, b)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 17, 8)
    assert stats.hit_rate == pytest.approx(8 / 17)
    assert kv.make_prefix_cache_stats().queries == 0  # reset after taking
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0
    assert kv.leak_report() == []
