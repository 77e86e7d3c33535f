"""Incremental detokenization and stop-string detection, per request, in the frontend."""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

from enginecore.engine.piece_table import pending_build, piece_table
from enginecore.params import SamplingParams

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream


@functools.cache
def _decode_stream_class() -> type[DecodeStream]:
    from tokenizers.decoders import DecodeStream

    return DecodeStream


def _decode_stream(skip_special_tokens: bool) -> DecodeStream:
    return _decode_stream_class()(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns token ids into text as they arrive, without re-decoding the whole output.

    Fast tokenizers use the tokenizers library's ``DecodeStream`` (it buffers partial
    UTF-8 sequences); other tokenizers fall back to decoding the whole output each step.
    Stop strings are searched only in the tail that the new text could complete.

    A token whose text does not depend on its neighbours (see
    :mod:`enginecore.engine.piece_table`) following another such token is looked up
    instead of decoded; the stream is then stale, and before it decodes again it is
    restarted from the last token, which leaves it where it would have been. A request
    made while the table is still being built takes it up when it lands.

    A plain step's token (:meth:`add_token`) is only queued: the text is folded in when
    it is read (:attr:`text`) or before the next :meth:`update`, by the same per-token
    steps, so that a request whose text is read only when it finishes (``LLM.generate``)
    pays nothing per step, and a run of queued tokens that are all in the table is
    joined in one gather.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._text = ""
        # Tokens of plain steps not yet folded into ``_text`` (see :meth:`add_token`).
        self._queued: list[int] = []
        self._stream: DecodeStream | None = None
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._ids: list[int] = []  # only for the slow path
        self._pieces: dict[int, str] = {}
        # Whether the last token is in the table and the stream's text ends after it.
        self._steady = False
        # Set when tokens were looked up: the last of them, to restart the stream from.
        self._looked_up: int | None = None
        # Set while the table is built in the background: checked before each decode.
        self._table_lands: threading.Event | None = None
        if self._backend is not None:
            self._stream = _decode_stream(self.skip_special_tokens)
            self._table_lands = pending_build(tokenizer)
            self._pieces = piece_table(tokenizer, wait_for_background=False)

    def _piece(self, token_id: int) -> str:
        """The text ``token_id`` adds (empty while it completes nothing), looked up when
        it and the token before are in the piece table, else from the stream."""
        if self._steady:
            piece = self._pieces.get(token_id)
            if piece is not None:
                self._looked_up = token_id
                return piece
        return self._stream_piece(token_id)

    def _stream_piece(self, token_id: int) -> str:
        stream = self._stream
        assert stream is not None  # only fast tokenizers have a piece table
        if self._table_lands is not None and self._table_lands.is_set():
            self._table_lands = None
            self._pieces = piece_table(self.tokenizer, wait_for_background=False)
        if self._looked_up is not None:
            # The stream's state after one table token is that of a stream that started
            # with it (its text ended there; no partial sequence was pending).
            stream = self._stream = _decode_stream(self.skip_special_tokens)
            stream.step(self._backend, self._looked_up)
            self._looked_up = None
        piece = stream.step(self._backend, token_id)
        self._steady = bool(piece) and token_id in self._pieces
        return piece or ""

    def _decode_new(self, token_ids: list[int]) -> str:
        if self._stream is not None:
            return "".join([self._piece(token_id) for token_id in token_ids])
        self._ids.extend(token_ids)
        full: str = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        new, self._slow_text = full[len(getattr(self, "_slow_text", "")) :], full
        return new

    @property
    def streams_plainly(self) -> bool:
        """Whether :meth:`add_token` serves this request: a fast tokenizer, no stop
        strings to search for."""
        return self._stream is not None and not self.stop

    @property
    def queued(self) -> list[int]:
        """The tokens :meth:`add_token` queued and not yet folded into the text: the
        output processor appends a plain step's tokens here in bulk (a request that
        :attr:`streams_plainly` only)."""
        return self._queued

    def add_token(self, token_id: int) -> None:
        """:meth:`update` for one token of a request that :attr:`streams_plainly`: queued,
        folded into the text when the text is next read."""
        self._queued.append(token_id)

    def add_token_to_text(self, token_id: int) -> None:
        """:meth:`add_token` for a request whose text is read after every token (a
        stream): decoded now, as queuing it would only add a call to each read."""
        if self._queued:
            self.fold_queued()
        if self._steady and (piece := self._pieces.get(token_id)) is not None:
            self._looked_up = token_id
        else:
            piece = self._stream_piece(token_id)
        self._text += piece

    @property
    def text(self) -> str:
        if self._queued:
            self.fold_queued()
        return self._text

    def fold_queued(self) -> None:
        """The queued tokens' text, appended, as :meth:`_piece` would have given it one
        token at a time: every token is looked up at once (a C-level gather); each run
        of table tokens that follows a steady text is joined from it whole, and only the
        tokens between runs (not in the table, or just after one) go through the
        stream."""
        queued = self._queued
        if len(queued) == 1:  # a streaming request reads its text every step
            self._text += self._piece(queued.pop())
            return
        queued = queued.copy()  # the list itself stays: appenders hold it
        self._queued.clear()
        pieces = self._pieces
        looked_up: list[str | None] = list(map(pieces.get, queued))
        if self._steady and None not in looked_up:
            self._looked_up = queued[-1]
            self._text += "".join(looked_up)  # type: ignore[arg-type]
            return
        misses = [i for i, piece in enumerate(looked_up) if piece is None]
        parts: list[str] = []
        i = m = 0
        n = len(queued)
        while i < n:
            if self._steady:
                while m < len(misses) and misses[m] < i:
                    m += 1
                end = misses[m] if m < len(misses) else n
                if end > i:
                    parts += looked_up[i:end]  # type: ignore[arg-type]
                    self._looked_up = queued[end - 1]
                    i = end
                    continue
            parts.append(self._stream_piece(queued[i]))
            i += 1
            if self._pieces is not pieces:  # the table landed during that decode
                pieces = self._pieces
                looked_up = list(map(pieces.get, queued))
                misses = [j for j, piece in enumerate(looked_up) if piece is None]
                m = 0
        self._text += "".join(parts)

    def update(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string if one now appears (text is then cut)."""
        if self._queued:
            self.fold_queued()
        new_text = self._decode_new(token_ids)
        if not new_text:
            return None
        start = max(0, len(self._text) - self._max_stop_len + 1)
        self._text += new_text
        if not self.stop:
            return None
        window = self._text[start:]
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = window.find(stop)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        cut = start + idx + (len(stop) if self.include_stop else 0)
        self._text = self._text[:cut]
        return stop

    @property
    def stop_holdback(self) -> int:
        """Characters a stream must hold back: the longest stop string could still be
        completing in them (and would then be cut from ``text``)."""
        return max(self._max_stop_len - 1, 0)

    def decode_token(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
