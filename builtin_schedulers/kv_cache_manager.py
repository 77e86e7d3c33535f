"""Per-request KV block bookkeeping on top of the block pool, with prefix caching.

The manager never touches tensors: a "KV cache" here is block ids and ref counts. The
model runner owns the memory those ids index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from enginecore.builtin_schedulers.block_hash import BlockHasher
from enginecore.builtin_schedulers.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from enginecore.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the stats were last taken (counted in tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _RequestBlocks:
    """What the manager keeps per request: its blocks and how many of them are cached."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0  # leading blocks already hashed into the cache (or skipped)


def _skips_cache_lookup(request: Request) -> bool:
    # Prompt logprobs need logits for every prompt token, so nothing may be skipped; the
    # request still populates the cache for others.
    return getattr(request.sampling_params, "prompt_logprobs", None) is not None


class KVCacheManager:
    """Allocates, caches and frees KV blocks for requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(block_size, hash_algo)
        self._reqs: dict[str, _RequestBlocks] = {}
        self._stats = PrefixCacheStats()

    # --- lookup ------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        The hit is capped at ``num_tokens - 1``: a fully cached prompt still computes its
        last token, since the model must produce logits for it. Takes no references;
        pass the result to :meth:`allocate_slots`.
        """
        if not self.enable_caching or _skips_cache_lookup(request):
            return [], 0
        num_tokens = request.num_tokens
        hashes = self.hasher.update(request)
        max_blocks = (num_tokens - 1) // self.block_size
        cached = self.block_pool.cached_blocks
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        stats = self._stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    # --- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        *,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Layout of the request's blocks: already computed | ``new_computed_blocks``
        (prefix hits covering ``num_new_computed_tokens``) | new tokens | lookahead
        (draft) slots. Returns the newly allocated blocks (possibly none), or None when
        the pool cannot supply them, in which case nothing at all has changed.
        ``cache=False`` leaves the new blocks unhashed (a KV connector is still loading
        them; :meth:`cache_blocks` once their contents are in place).
        """
        if num_new_tokens <= 0 and not num_lookahead_tokens:
            raise ValueError("num_new_tokens must be > 0")
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _RequestBlocks()
        blocks = state.blocks
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        if num_total > self.max_model_len:
            num_total = self.max_model_len
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = -(-num_total // bs) - len(blocks) - num_hits

        if num_new_blocks > 0 or num_hits:
            pool = self.block_pool
            # Free hit blocks leave the free list when touched, so they count against it.
            num_free = pool.free_queue.num_free
            # num_hits > 0: new_computed_blocks is a non-empty list.
            if num_hits:
                num_free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # type: ignore[union-attr]
            if num_new_blocks > num_free:
                if not blocks:
                    del self._reqs[request.request_id]
                return None
            if num_hits:  # new_computed_blocks is a non-empty list (as above)
                pool.touch(new_computed_blocks)  # type: ignore[arg-type]
                blocks.extend(new_computed_blocks)  # type: ignore[arg-type]
                state.num_cached = max(state.num_cached, len(blocks))
            new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
            blocks.extend(new_blocks)
        else:
            new_blocks = []

        if self.enable_caching and cache:
            # Cache full blocks now, not after the forward pass: a request admitted later
            # in this same step can already share them. Never cache beyond the known
            # tokens (async placeholders and draft tokens are not known yet).
            num_known = num_computed + num_new_tokens
            num_tokens = len(request.all_token_ids)
            if num_known > num_tokens:
                num_known = num_tokens
            if num_known // bs > state.num_cached:
                self._cache_full_blocks(request, state, num_known // bs)
        return new_blocks

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        hashes = self.hasher.update(request, num_full * self.block_size)
        cache_block = self.block_pool.cache_block
        blocks = state.blocks
        for i in range(state.num_cached, min(num_full, len(blocks))):
            cache_block(blocks[i], hashes[i])
        state.num_cached = max(state.num_cached, min(num_full, len(blocks)))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` known tokens."""
        state = self._reqs.get(request.request_id)
        if state is None or not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full > state.num_cached:
            self._cache_full_blocks(request, state, num_full)

    def uncache_blocks(self, block_ids: set[int]) -> None:
        """Make these blocks unfindable by hash: their contents are not to be trusted
        (a KV connector reported them invalid after a load)."""
        pool = self.block_pool
        for block_id in block_ids:
            block = pool.blocks[block_id]
            h = block.block_hash
            if h is not None:
                if pool.cached_blocks.get(h) is block:
                    del pool.cached_blocks[h]
                block.block_hash = None

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so a chain's tail is evicted first)."""
        state = self._reqs.get(request.request_id)
        if state is None:
            return
        # Blocks whose tokens became known only after their allocation (async outputs).
        self.cache_blocks(request, request.num_computed_tokens)
        del self._reqs[request.request_id]
        self.block_pool.free_blocks(reversed(state.blocks))

    # --- queries -----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        state = self._reqs.get(request_id)
        return state.blocks if state is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        state = self._reqs.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Fails (False, nothing changed) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (then reset)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def leak_report(self) -> list[str]:
        """Empty when no request holds blocks and every block is free (possibly cached)."""
        problems = self.block_pool.leak_report()
        if self._reqs:
            problems.insert(0, f"requests still hold blocks: {sorted(self._reqs)[:20]}")
        return problems
