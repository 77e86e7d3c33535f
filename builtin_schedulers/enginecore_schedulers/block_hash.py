"""Chained prefix-cache block hashes, computed incrementally on each request.

``hash(block i) = H(hash(block i-1) or NONE_HASH, tokens of block i, extra keys)``, so
equal hashes imply equal prefixes. Extra keys hold the request's ``cache_salt`` on the
first block only (the chain carries it to every later block).

Two algorithms (``cache.prefix_caching_hash_algo``):

* ``sha256``: SHA-256 over a fixed little-endian byte encoding. Identical in every
  process and on every machine, which KV connectors need to find blocks by hash.
* ``builtin``: Python's tuple ``hash()``, several times faster but a 64-bit value that
  is only meaningful inside one process (string salts hash differently per process).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginecore.request import Request
    from enginecore_schedulers.block_pool import BlockHash

# Parent of every first block. Fixed (not random per process) so sha256 hashes agree
# across processes and restarts.
NONE_HASH_SHA256: bytes = hashlib.sha256(b"enginecore/prefix-cache/none-hash/v1").digest()
NONE_HASH_BUILTIN: int = 0x5EED_0F_B10C_4A54

# The parent is the kind of hash the function returns (bytes or int), which the Callable
# type cannot say: it takes that parent as Any.
BlockHashFn = Callable[[Any, Sequence[int], "str | None"], "BlockHash"]


def sha256_block_hash(
    parent: bytes | None, token_ids: Sequence[int], extra: str | None = None
) -> bytes:
    """SHA-256 of (parent, token count + int64 LE tokens, tagged extra key)."""
    h = hashlib.sha256(NONE_HASH_SHA256 if parent is None else parent)
    n = len(token_ids)
    h.update(struct.pack(f"<I{n}q", n, *token_ids))
    if extra is not None:
        salt = extra.encode()
        h.update(b"\x01" + struct.pack("<I", len(salt)) + salt)
    return h.digest()


def builtin_block_hash(
    parent: int | None, token_ids: Sequence[int], extra: str | None = None
) -> int:
    return hash((NONE_HASH_BUILTIN if parent is None else parent, tuple(token_ids), extra))


HASH_FUNCTIONS: dict[str, BlockHashFn] = {
    "sha256": sha256_block_hash,
    "builtin": builtin_block_hash,
}


def get_hash_fn(algo: str) -> BlockHashFn:
    try:
        return HASH_FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"unknown prefix_caching_hash_algo {algo!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def first_block_key(request: Request) -> str | None:
    """The extra key of a request's first block: its cache salt and its LoRA adapter
    (blocks computed with one adapter are never reused by another, or by the base)."""
    lora = request.lora_request
    if lora is None:
        return request.cache_salt
    if request.cache_salt is None:
        return lora.cache_key
    return f"{request.cache_salt}\x00{lora.cache_key}"


class BlockHasher:
    """Extends ``request.block_hashes`` to cover every full block, hashing only new ones."""

    __slots__ = ("block_size", "hash_fn")

    def __init__(self, block_size: int, algo: str = "sha256") -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(algo)

    def update(self, request: Request, num_tokens: int | None = None) -> list[BlockHash]:
        """Hash the full blocks among the first ``num_tokens`` (default: all) tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        end = (len(tokens) if num_tokens is None else num_tokens) // bs
        i = len(hashes)
        if i >= end:
            return hashes
        hash_fn = self.hash_fn
        parent = hashes[-1] if i else None
        while i < end:
            start = i * bs
            parent = hash_fn(
                parent, tokens[start : start + bs], first_block_key(request) if i == 0 else None
            )
            hashes.append(parent)
            i += 1
        return hashes
