"""Per-request KV block bookkeeping on top of the block pool, with prefix caching.

The manager never touches tensors: a "KV cache" here is block ids and ref counts. The
model runner owns the memory those ids index.

KV cache groups (vLLM's hybrid KV cache manager): the model's attention layers are split
into groups that share an attention spec, full attention or a sliding window of ``W``
positions. Each group has its own block list per request, and every group draws from the
one block pool. A sliding group releases the blocks that no future token of the request
can see (replaced by the null block), so a long request holds about ``ceil(W /
block_size) + 1`` blocks in it instead of all of them. A model without sliding layers
has one full-attention group and behaves exactly as without groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from enginecore_schedulers.block_hash import BlockHasher
from enginecore_schedulers.block_pool import BlockHash, BlockPool, CacheKey, KVCacheBlock

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
    """What the manager keeps per request and group: its blocks (the null block where a
    sliding group released one) and how many of them are cached."""

    __slots__ = ("blocks", "num_cached", "num_skipped")

    def __init__(self) -> None:
        self.blocks: list[KVCacheBlock] = []
        self.num_cached = 0  # leading blocks already hashed into the cache (or skipped)
        self.num_skipped = 0  # leading blocks released (out of the window for good)


def _skips_cache_lookup(request: Request) -> bool:
    # Prompt logprobs need logits for every prompt token, and pooling needs every prompt
    # token's hidden state, so nothing may be skipped; the request still populates the
    # cache for others.
    params = request.sampling_params
    return (
        getattr(params, "prompt_logprobs", None) is not None
        or getattr(params, "pooling", None) is not None
    )


class KVCacheManager:
    """Allocates, caches and frees KV blocks for requests.

    ``kv_cache_groups`` is the sliding window of each KV cache group (``None``: full
    attention); unset, there is one full-attention group. With one group the methods take
    and return plain block lists; with several, ``get_computed_blocks`` and
    ``allocate_slots`` take and return one list per group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        kv_cache_groups: Sequence[int | None] | None = None,
        num_rollback_tokens: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(block_size, hash_algo)
        windows: list[int | None] = list(kv_cache_groups) if kv_cache_groups else [None]
        for window in windows:
            if window is not None and (not isinstance(window, int) or window < 1):
                raise ValueError(f"a KV cache group's sliding window must be >= 1, got {window!r}")
        self.group_windows: list[int | None] = windows
        self.num_groups = len(windows)
        # Speculative decoding may roll num_computed_tokens back by up to this many
        # tokens: a sliding group keeps the window of the earliest position it may restart at.
        self.num_rollback_tokens = num_rollback_tokens
        self._reqs: dict[str, list[_RequestBlocks]] = {}
        self._stats = PrefixCacheStats()

    def _cache_key(self, group: int, block_hash: BlockHash) -> CacheKey:
        # Group 0 keys by the plain hash (one group: exactly the layout without groups).
        return block_hash if group == 0 else (group, block_hash)

    def _window_blocks(self, window: int, num_tokens: int) -> int:
        """Index of the first block the token at position ``num_tokens`` can see."""
        return max(num_tokens - window + 1, 0) // self.block_size

    # --- lookup ------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        """The longest cached prefix of the request's tokens, as blocks and a token count.

        The hit is capped at ``num_tokens - 1``: a fully cached prompt still computes its
        last token, since the model must produce logits for it. A sliding group only
        needs the cached blocks inside the window of the hit's end (the rest are the null
        block); the hit is the longest length every group can serve. Takes no
        references; pass the result to :meth:`allocate_slots`.
        """
        if not self.enable_caching or _skips_cache_lookup(request):
            return ([] if self.num_groups == 1 else [[] for _ in range(self.num_groups)]), 0
        num_tokens = request.num_tokens
        hashes = self.hasher.update(request)
        max_blocks = (num_tokens - 1) // self.block_size
        cached = self.block_pool.cached_blocks
        num_hit = max_blocks
        per_group: list[list[KVCacheBlock]] = []
        hits: list[KVCacheBlock] = []
        if self.group_windows == [None]:
            for block_hash in hashes[:max_blocks]:
                block = cached.get(block_hash)
                if block is None:
                    break
                hits.append(block)
            num_hit = len(hits)
        else:
            # Full groups: the longest run of cached leading blocks. Sliding groups: the
            # longest length whose window blocks are cached. Shrink until all agree.
            for g, window in enumerate(self.group_windows):
                if window is None:
                    n = 0
                    while n < num_hit and cached.get(self._cache_key(g, hashes[n])) is not None:
                        n += 1
                    num_hit = n
            changed = True
            while changed and num_hit:
                changed = False
                for g, window in enumerate(self.group_windows):
                    if window is not None:
                        n = self._sliding_hit(g, window, hashes, num_hit)
                        if n < num_hit:
                            num_hit, changed = n, True
            null = self.block_pool.null_block
            for g, window in enumerate(self.group_windows):
                first = (
                    0 if window is None else self._window_blocks(window, num_hit * self.block_size)
                )
                per_group.append(
                    [null] * first + [cached[self._cache_key(g, h)] for h in hashes[first:num_hit]]
                )
        num_hit_tokens = num_hit * self.block_size
        stats = self._stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens
        if self.group_windows == [None]:
            return hits, num_hit_tokens
        return (per_group[0] if self.num_groups == 1 else per_group), num_hit_tokens

    def _sliding_hit(self, group: int, window: int, hashes: list[BlockHash], limit: int) -> int:
        """The most leading blocks (at most ``limit``) after which this sliding group has
        every block the next token can see."""
        cached = self.block_pool.cached_blocks
        n = limit
        while n > 0:
            first = self._window_blocks(window, n * self.block_size)
            missing = next(
                (
                    i
                    for i in range(n - 1, first - 1, -1)
                    if cached.get(self._cache_key(group, hashes[i])) is None
                ),
                None,
            )
            if missing is None:
                return n
            n = missing  # any longer hit would need this block
        return 0

    # --- allocation --------------------------------------------------------------------

    def one_more_token_fits(self, requests: Sequence[Request]) -> list[bool] | None:
        """Per request, in one pass over the batch: whether one token after its computed
        ones fits the blocks it holds and completes no block that is not cached yet, so
        that :meth:`allocate_slots` for it (one token, no lookahead) would change nothing
        and return no block. None where that check does not apply (several KV cache
        groups, or a sliding window): every request then takes ``allocate_slots``."""
        if self.group_windows != [None]:
            return None
        held = self._reqs
        bs = self.block_size
        caching = self.enable_caching
        fits: list[bool] = []
        for request in requests:
            groups = held.get(request.request_id)
            if groups is None:
                fits.append(False)
                continue
            state = groups[0]
            num_known = request.num_computed_tokens + 1
            if num_known > len(state.blocks) * bs:
                fits.append(False)
            elif caching:
                num_tokens = len(request.all_token_ids)
                full = (num_known if num_known < num_tokens else num_tokens) // bs
                fits.append(full <= state.num_cached)
            else:
                fits.append(True)
        return fits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        *,
        cache: bool = True,
    ) -> Any:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Layout of the request's blocks: already computed | ``new_computed_blocks``
        (prefix hits covering ``num_new_computed_tokens``) | new tokens | lookahead
        (draft) slots. Returns the newly allocated blocks (possibly none; one list per
        group with several groups), or None when the pool cannot supply them, in which
        case nothing has changed but the release of blocks no token can see any more.
        ``cache=False`` leaves the new blocks unhashed (a KV connector is still loading
        them; :meth:`cache_blocks` once their contents are in place).
        """
        if num_new_tokens <= 0 and not num_lookahead_tokens:
            raise ValueError("num_new_tokens must be > 0")
        groups = self._reqs.get(request.request_id)
        if (
            groups is not None
            and self.group_windows == [None]
            and not num_new_computed_tokens
            and not num_lookahead_tokens
            and not new_computed_blocks
        ):
            # One group, no window, no prefix hits, no drafts: the blocks past the held
            # ones, then the blocks the known tokens fill cached (none, in the common
            # decode step). The general path below gives the same result.
            state = groups[0]
            bs = self.block_size
            num_known = request.num_computed_tokens + num_new_tokens
            num_total = num_known if num_known < self.max_model_len else self.max_model_len
            num_wanted = -(-num_total // bs) - len(state.blocks)
            new_blocks: list[KVCacheBlock] = []
            if num_wanted > 0:
                if num_wanted > self.block_pool.free_queue.num_free:
                    if not state.blocks:
                        del self._reqs[request.request_id]
                    return None
                new_blocks = self.block_pool.get_new_blocks(num_wanted)
                state.blocks.extend(new_blocks)
            if self.enable_caching and cache:
                num_tokens = len(request.all_token_ids)
                num_full = (num_known if num_known < num_tokens else num_tokens) // bs
                if num_full > state.num_cached:
                    self._cache_full_blocks(request, 0, state, num_full)
            return new_blocks
        if groups is None:
            groups = self._reqs[request.request_id] = [
                _RequestBlocks() for _ in range(self.num_groups)
            ]
        bs = self.block_size
        pool = self.block_pool
        hits_of = (
            [new_computed_blocks or []]
            if self.num_groups == 1
            else (new_computed_blocks or [[] for _ in range(self.num_groups)])
        )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if request.num_computed_tokens:
            self._release_out_of_window(groups, request.num_computed_tokens)
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        if num_total > self.max_model_len:
            num_total = self.max_model_len
        num_blocks_total = -(-num_total // bs)
        wanted = [
            num_blocks_total - len(state.blocks) - len(hits)
            for state, hits in zip(groups, hits_of, strict=True)
        ]
        num_wanted = sum(n for n in wanted if n > 0)
        any_hits = any(hits_of)
        new_of: list[list[KVCacheBlock]] = [[] for _ in groups]
        if num_wanted or any_hits:
            # Free hit blocks leave the free list when touched, so they count against it.
            num_free = pool.free_queue.num_free
            if any_hits:
                touched = {
                    id(b)
                    for hits in hits_of
                    for b in hits
                    if b.ref_cnt == 0 and b is not pool.null_block
                }
                num_free -= len(touched)
            if num_wanted > num_free:
                if not any(state.blocks for state in groups):
                    del self._reqs[request.request_id]
                return None
            for g, (state, hits) in enumerate(zip(groups, hits_of, strict=True)):
                if hits:
                    real = [b for b in hits if b is not pool.null_block]
                    pool.touch(real)
                    state.num_skipped = max(state.num_skipped, len(hits) - len(real))
                    state.blocks.extend(hits)
                    state.num_cached = max(state.num_cached, len(state.blocks))
                if wanted[g] > 0:
                    new_of[g] = pool.get_new_blocks(wanted[g])
                    state.blocks.extend(new_of[g])

        if self.enable_caching and cache:
            # Cache full blocks now, not after the forward pass: a request admitted later
            # in this same step can already share them. Never cache beyond the known
            # tokens (async placeholders and draft tokens are not known yet).
            num_known = num_computed + num_new_tokens
            num_tokens = len(request.all_token_ids)
            if num_known > num_tokens:
                num_known = num_tokens
            for g, state in enumerate(groups):
                if num_known // bs > state.num_cached:
                    self._cache_full_blocks(request, g, state, num_known // bs)
        return new_of[0] if self.num_groups == 1 else new_of

    def _release_out_of_window(self, groups: list[_RequestBlocks], num_computed: int) -> None:
        """Give sliding groups' blocks that no future token can see back to the pool."""
        start = num_computed - self.num_rollback_tokens
        null = self.block_pool.null_block
        for window, state in zip(self.group_windows, groups, strict=True):
            if window is None:
                continue
            end = min(self._window_blocks(window, start), len(state.blocks))
            if end <= state.num_skipped:
                continue
            blocks = state.blocks
            released = [b for b in blocks[state.num_skipped : end] if b is not null]
            for i in range(state.num_skipped, end):
                blocks[i] = null
            state.num_skipped = end
            self.block_pool.free_blocks(reversed(released))

    def _cache_full_blocks(
        self, request: Request, group: int, state: _RequestBlocks, num_full: int
    ) -> None:
        hashes = self.hasher.update(request, num_full * self.block_size)
        cache_block = self.block_pool.cache_block
        null = self.block_pool.null_block
        blocks = state.blocks
        for i in range(state.num_cached, min(num_full, len(blocks))):
            if blocks[i] is not null:  # released before its tokens were known
                cache_block(blocks[i], self._cache_key(group, hashes[i]))
        state.num_cached = max(state.num_cached, min(num_full, len(blocks)))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` known tokens."""
        groups = self._reqs.get(request.request_id)
        if groups is None or not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        for g, state in enumerate(groups):
            if num_full > state.num_cached:
                self._cache_full_blocks(request, g, state, num_full)

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
        groups = self._reqs.get(request.request_id)
        if groups is None:
            return
        # Blocks whose tokens became known only after their allocation (async outputs).
        self.cache_blocks(request, request.num_computed_tokens)
        del self._reqs[request.request_id]
        null = self.block_pool.null_block
        for state in groups:
            self.block_pool.free_blocks(b for b in reversed(state.blocks) if b is not null)

    # --- queries -----------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The first group's blocks (the only group's, for most models)."""
        groups = self._reqs.get(request_id)
        return groups[0].blocks if groups is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's block ids (0 where a sliding group released a block)."""
        groups = self._reqs.get(request_id)
        return [b.block_id for b in groups[0].blocks] if groups is not None else []

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Every group's block ids, in group order."""
        groups = self._reqs.get(request_id)
        if groups is None:
            return [[] for _ in range(self.num_groups)]
        return [[b.block_id for b in state.blocks] for state in groups]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (released ones not counted)."""
        groups = self._reqs.get(request_id)
        if groups is None:
            return [0] * self.num_groups
        null = self.block_pool.null_block
        return [sum(1 for b in state.blocks if b is not null) for state in groups]

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
