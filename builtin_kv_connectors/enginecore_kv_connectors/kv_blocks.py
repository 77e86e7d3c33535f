"""What the built-in connectors share: prefix keys, the KV layout, and checksummed blocks.

A block travels (on disk or over ZeroMQ) as the K/V of every layer of this rank for
``block_size`` positions, ``[num_layers, 2, block_size, kv_heads, head_dim]``, preceded
by a small header that names its layout, the SHA-256 of its bytes and (over the network)
the prefix key of the block it holds. A reader checks all of them before the bytes go
anywhere near the KV cache: a truncated or corrupted block, or one that belongs to
another prompt, is reported invalid (and recomputed), never used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from enginecore.config import EngineConfig

_MAGIC = b"ECKVBLK1"
_ROOT_KEY = hashlib.sha256(b"enginecore/kv-connector/prefix/v1").digest()


class InvalidBlockError(ValueError):
    """A block's bytes do not match its header (truncated, corrupted or another layout)."""


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[str]:
    """One hex key per full block: SHA-256 chained over the blocks, so equal keys mean
    equal prefixes (and equal cache salts). Stable across processes and machines."""
    keys = []
    parent = _ROOT_KEY
    for i in range(len(token_ids) // block_size):
        h = hashlib.sha256(parent)
        if i == 0 and salt:
            h.update(b"salt:" + salt.encode())
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        h.update(struct.pack(f"<{block_size}q", *chunk))
        parent = h.digest()
        keys.append(parent.hex())
    return keys


def model_namespace(config: EngineConfig) -> str:
    """Blocks of different models, dtypes or block sizes must never meet: a short key
    over the checkpoint's config.json and the settings that shape the KV cache."""
    h = hashlib.sha256()
    checkpoint = Path(config.model.path)
    config_json = checkpoint / "config.json" if checkpoint.is_dir() else checkpoint
    try:
        h.update(config_json.read_bytes() if config_json.is_file() else str(checkpoint).encode())
    except OSError:
        h.update(str(checkpoint).encode())
    par = config.parallel
    shape = [config.model.dtype, config.cache.tokens_per_block]
    shape += [par.tensor_parallel_size, par.pipeline_parallel_size]
    h.update(json.dumps(shape).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class KVLayout:
    """The per-block layout of this rank's cache: ``[layers, 2, block_size, heads, dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> KVLayout:
        _, _, block_size, heads, dim = kv_caches[0].shape
        dtype = str(kv_caches[0].dtype).removeprefix("torch.")
        return cls(len(kv_caches), block_size, heads, dim, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def header(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """A copy of the blocks' K/V as ``[n, layers, 2, block_size, heads, dim]``."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0].device)
    per_layer = [cache.index_select(1, index) for cache in kv_caches]  # [2, n, bs, h, d]
    return torch.stack(per_layer).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor) -> None:
    """Write ``[n, layers, 2, block_size, heads, dim]`` into the cache blocks."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0].device)
    data = data.to(kv_caches[0].device)
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(1, index, data[:, layer].transpose(0, 1))


def encode_block(layout: KVLayout, block: torch.Tensor, key: str | None = None) -> bytes:
    """Header line + raw bytes of one ``[layers, 2, block_size, heads, dim]`` block;
    ``key`` (its prefix key) names the prompt prefix it belongs to."""
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    header = layout.header() | {
        "nbytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    if key is not None:
        header["key"] = key
    line = json.dumps(header, separators=(",", ":")).encode()
    return _MAGIC + struct.pack("<I", len(line)) + line + payload


def decode_block(
    layout: KVLayout, raw: bytes, dtype: torch.dtype, key: str | None = None
) -> torch.Tensor:
    """The block's tensor, or :class:`InvalidBlockError` saying what is wrong. With
    ``key``, the block must say it holds that prefix (not another prompt's KV)."""
    if len(raw) < len(_MAGIC) + 4 or not raw.startswith(_MAGIC):
        raise InvalidBlockError("not an enginecore KV block (bad magic or truncated header)")
    (length,) = struct.unpack_from("<I", raw, len(_MAGIC))
    start = len(_MAGIC) + 4
    try:
        header = json.loads(raw[start : start + length])
    except ValueError as exc:
        raise InvalidBlockError(f"unreadable block header: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidBlockError("unreadable block header: not an object")
    if key is not None and header.get("key") != key:
        raise InvalidBlockError("the block belongs to another prompt prefix than the request's")
    if header.get("shape") != list(layout.shape) or header.get("dtype") != layout.dtype:
        raise InvalidBlockError(
            f"block layout {header.get('shape')}/{header.get('dtype')} does not match this "
            f"cache's {list(layout.shape)}/{layout.dtype}"
        )
    payload = raw[start + length :]
    if len(payload) != header.get("nbytes"):
        raise InvalidBlockError(
            f"truncated block: {len(payload)} of {header.get('nbytes')} payload bytes"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise InvalidBlockError("block checksum mismatch (corrupted contents)")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).view(layout.shape)
