"""The text each token adds when its decoding does not depend on its neighbours.

Detokenizing a step token by token through ``tokenizers``' ``DecodeStream`` decodes the
previous token and the new one together and keeps the difference: two decodes per
token per request. For most tokens of the common tokenizers the difference is always
the same string: a byte-level BPE token whose bytes are a whole UTF-8 sequence, a
SentencePiece token that is not a byte-fallback piece (its ``▁`` is a space everywhere
but at the start of the text). :func:`piece_table` finds those tokens once per tokenizer
and maps each to its text, so that :class:`~enginecore.engine.detokenizer.IncrementalDetokenizer`
appends a looked-up string instead of decoding.

A token is in the table when the tokenizer's decoder is one whose steps act on each
token alone, bar the first token's leading space (byte-level, metaspace, and sequences
of replace / byte-fallback / fuse / strip, as GPT-2, Llama and Qwen tokenizers use), it
is not an added token, and decoding it after each of two different tokens adds the same
non-empty text with no replacement character (so no partial UTF-8 sequence, no byte
fallback, no skipped special token). Anything else falls back to ``DecodeStream``.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

# Decoders that act on each token's string alone (Fuse joins, Strip then acts on the
# joined text's ends, Metaspace strips the first token's leading space only).
_CONTEXT_FREE_DECODERS = frozenset(
    {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
)

# One table per tokenizer, dropped with it. Added tokens (special ones among them) are never
# in a table, so ``skip_special_tokens`` does not change it.
_tables: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
# Tables being built on a background thread: set when the table lands.
_building: weakref.WeakKeyDictionary[Any, threading.Event] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _decoder_steps(backend: Any) -> set[str] | None:
    """The decoder's step types, or None if one of them is not context-free."""
    if backend.decoder is None:
        return None
    decoder = json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps}
    return types if types and types <= _CONTEXT_FREE_DECODERS else None


def _reference_tokens(backend: Any, ids: list[int]) -> list[int]:
    """Two tokens with plain text of their own, ending in different characters."""
    found: list[int] = []
    last_chars: set[str] = set()
    for token_id in ids:
        text = backend.decode([token_id])
        if text and "\ufffd" not in text and text[-1] not in last_chars:
            found.append(token_id)
            last_chars.add(text[-1])
            if len(found) == 2:
                break
    return found


def build_piece_table(tokenizer: Any) -> dict[int, str]:
    """Token id -> the text it adds after any token in the table (empty: no fast path)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    steps = _decoder_steps(backend) if backend is not None else None
    if backend is None or steps is None:
        return {}
    excluded = set(backend.get_added_tokens_decoder())
    if "ByteFallback" in steps:  # a byte piece joins the bytes of its neighbours
        vocab = backend.get_vocab(with_added_tokens=False)
        excluded.update(i for token, i in vocab.items() if _BYTE_PIECE.fullmatch(token))
    ids = [i for i in range(backend.get_vocab_size(with_added_tokens=True)) if i not in excluded]
    references = _reference_tokens(backend, ids)
    if len(references) < 2:
        return {}
    pieces: dict[int, str] | None = None
    for ref in references:
        prefix = backend.decode([ref])
        # Tuples, not lists: tens of thousands of new lists set off the garbage collector.
        texts = backend.decode_batch(list(zip(itertools.repeat(ref), ids)))
        after: dict[int, str] = {}
        for token_id, text in zip(ids, texts, strict=True):
            piece = text[len(prefix) :]
            if text.startswith(prefix) and piece and "\ufffd" not in piece:
                after[token_id] = piece
        if pieces is None:
            pieces = after
        else:
            pieces = {i: p for i, p in pieces.items() if after.get(i) == p}
    return pieces or {}


def build_in_background(tokenizer: Any) -> None:
    """Start building ``tokenizer``'s table on a daemon thread, so that start-up does not
    wait for it; detokenizers made before it lands decode through the stream."""
    with _lock:
        try:
            if tokenizer in _tables or tokenizer in _building:
                return
            done = _building[tokenizer] = threading.Event()
        except TypeError:  # cannot be weakly referenced: built when first asked for
            return

    def build() -> None:
        try:
            table = build_piece_table(tokenizer)
        except Exception:  # the stream serves every token without a table
            logger.warning("no detokenizer piece table for this tokenizer", exc_info=True)
            table = {}
        with _lock:
            _tables[tokenizer] = table
            _building.pop(tokenizer, None)
        done.set()

    threading.Thread(target=build, name="piece-table", daemon=True).start()


def pending_build(tokenizer: Any) -> threading.Event | None:
    """The event set when ``tokenizer``'s background build lands; None when none runs."""
    try:
        with _lock:
            return _building.get(tokenizer)
    except TypeError:  # cannot be weakly referenced: never built in the background
        return None


def piece_table(tokenizer: Any, *, wait_for_background: bool = True) -> dict[int, str]:
    """:func:`build_piece_table`, built once per tokenizer. While a background build is
    running, an empty table unless ``wait_for_background``."""
    try:
        with _lock:
            table = _tables.get(tokenizer)
            pending = _building.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced: not cached
        return build_piece_table(tokenizer)
    if table is not None:
        return table
    if pending is not None:
        if not wait_for_background:
            return {}
        pending.wait()
        return _tables.get(tokenizer, {})
    table = build_piece_table(tokenizer)
    with _lock:
        _tables.setdefault(tokenizer, table)
    return table
