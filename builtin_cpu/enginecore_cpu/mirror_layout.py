"""The decode mirror's memory: per row, positions in chunks of whole 2 MiB pages.

Decode attention streams each row's K and V once a step; in 4 KiB pages every page costs
a TLB miss and stops the hardware prefetcher, so the mirror is read in huge pages where a
row is long. A dense ``[rows, kv_heads, capacity, head_dim]`` half cannot be: each head's
positions lie one capacity apart, so the few positions of a short context would make a
whole huge page resident per head. Here a row's positions come in chunks of ``chunk``
positions; a chunk holds every layer's K and V for them, each KV head's ``chunk``
positions side by side (the kernels still read long runs), and a row's chunk of all
layers is a whole number of huge pages. A row's chunks are advised into huge pages as the
row grows into them (:meth:`MirrorMemory.advise_row`): the first one once the row holds
half of it (its small pages collapsed in the background), each later one as the row
reaches it; the rest is advised out of huge pages, also where THP is ``always``. So a row
of ``L`` positions has no more resident than its positions' 4 KiB pages below half a
chunk, and at most twice its positions' bytes above (rounded up to whole chunks). Where
no row can reach half a chunk (a short ``max_model_len``), or whole chunks would not fit
the mirror's memory bound, the mirror is dense: one chunk of the whole length, in small
pages.

Each layer is a view ``[2, rows, chunks, kv_heads, chunk, head_dim]`` of one mapping;
:func:`geometry` says how the kernels address it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from enginecore_cpu.host_memory import HUGE_PAGE, advise_pages, collapse_in_background, zeroed

# Unused positions after each (row, head)'s run in a dense mirror. Without them a capacity
# of 4,096 positions puts every row's K and V exactly 1 MiB apart, where they alias in the
# cache: decode attention over 256 rows ran slower than with these few extra positions.
_T_PAD = 16
_CHUNK_ALIGN = 16  # positions: a head's run then starts on a cache line
# A layer's K (or V) of a chunk fills at most this many bytes: a few huge pages, so that
# each KV head's run in a chunk is long (attention read chunks of one huge page a layer
# slower than of four, whose runs are four times as long; see RESULTS.md). A row's chunk
# of every layer is padded to a whole number of them.
CHUNK_BYTES = 4 * HUGE_PAGE


@dataclass(frozen=True)
class MirrorLayout:
    """Where each position of a mirror of ``rows`` rows lies (sizes in elements)."""

    layers: int
    heads: int
    dim: int
    itemsize: int
    rows: int
    chunks: int  # a row's chunks
    chunk: int  # positions a chunk
    head_positions: int  # positions from one KV head's run to the next (chunk, or padded)
    chunk_elems: int  # from a row's chunk to its next (every layer's K and V, padded)
    half_elems: int  # from a layer's K in a chunk to its V, and on to the next layer's K
    huge: bool  # rows are advised into huge pages as they grow (chunks of whole pages)

    @classmethod
    def plan(
        cls,
        layers: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        rows: int,
        length: int,
        dense: bool = False,
    ) -> MirrorLayout:
        """The layout for ``rows`` rows of at least ``length`` positions each: in whole
        chunks (the capacity rounded up: untouched positions cost address space only)
        where a row may reach half a chunk, else (or with ``dense``) one dense chunk."""
        size = dtype.itemsize
        position = heads * dim * size  # bytes of a position in one layer's K (or V)
        chunk = max(_CHUNK_ALIGN, CHUNK_BYTES // position // _CHUNK_ALIGN * _CHUNK_ALIGN)
        if dense or 2 * length < chunk:  # one chunk: dense, in small pages
            run = length + _T_PAD
            half = heads * run * dim
            whole = layers * 2 * half
            return cls(layers, heads, dim, size, rows, 1, length, run, whole, half, False)
        half = heads * chunk * dim
        chunk_bytes = -(-layers * 2 * half * size // CHUNK_BYTES) * CHUNK_BYTES
        chunks = -(-length // chunk)
        whole = chunk_bytes // size
        return cls(layers, heads, dim, size, rows, chunks, chunk, chunk, whole, half, True)

    @property
    def capacity(self) -> int:
        """Positions a row holds."""
        return self.chunks * self.chunk

    @property
    def row_elems(self) -> int:
        return self.chunks * self.chunk_elems

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_elems * self.itemsize

    def huge_chunks(self, lengths: np.ndarray) -> np.ndarray:
        """How many of a row's first chunks are in huge pages once it holds ``lengths``
        positions: none below half a chunk (a short context keeps its 4 KiB pages), then
        every chunk it has reached."""
        reached = np.minimum(-(-lengths // self.chunk), self.chunks)
        return np.where(self.huge & (2 * lengths >= self.chunk), reached, 0)


class MirrorMemory:
    """One mapping that holds a mirror of ``layout``: each layer's view, and the advice
    that puts a row's chunks into huge pages as it grows."""

    def __init__(self, layout: MirrorLayout, dtype: torch.dtype) -> None:
        self.layout = s = layout
        # Room to start on a huge page boundary, so that each row's chunk is whole pages.
        spare = HUGE_PAGE // s.itemsize if s.huge else 0
        self._buffer = zeroed((s.rows * s.row_elems + spare,), dtype, torch.device("cpu"))
        base = self._buffer.data_ptr()
        offset = (-base % HUGE_PAGE) // s.itemsize if s.huge else 0
        self._base = base + offset * s.itemsize
        half = s.half_elems
        # No huge page until a row has grown into it, even where THP is ``always``.
        advise_pages(self._base, s.rows * s.row_elems * s.itemsize, huge=False)
        self.layers = [
            self._buffer.as_strided(
                (2, s.rows, s.chunks, s.heads, s.chunk, s.dim),
                (half, s.row_elems, s.chunk_elems, s.head_positions * s.dim, s.dim, 1),
                offset + layer * 2 * half,
            )
            for layer in range(s.layers)
        ]
        # [rows, chunks, layers * 2, heads, chunk, dim]: every layer's K and V at once
        self.whole = self._buffer.as_strided(
            (s.rows, s.chunks, s.layers * 2, s.heads, s.chunk, s.dim),
            (s.row_elems, s.chunk_elems, half, s.head_positions * s.dim, s.dim, 1),
            offset,
        )
        self.huge_rows = np.zeros(s.rows, np.int64)  # each row's chunks in huge pages
        self._collapsing: list[threading.Thread] = []

    def advise_row(self, row: int, length: int) -> None:
        """Advise row ``row``'s chunks into huge pages as far as a row of ``length``
        positions has them (:meth:`MirrorLayout.huge_chunks`), before they are written.
        The first chunk already holds small pages when advised: they are collapsed into
        huge pages in the background (:meth:`settle` waits for that)."""
        s = self.layout
        want, have = int(s.huge_chunks(np.array([length]))[0]), int(self.huge_rows[row])
        if want <= have:
            return
        chunk = s.chunk_elems * s.itemsize
        start = self._base + row * s.row_elems * s.itemsize + have * chunk
        advise_pages(start, (want - have) * chunk, huge=True)
        if have == 0:
            self._collapsing = [t for t in self._collapsing if t.is_alive()]
            self._collapsing.append(collapse_in_background(self._buffer, start, chunk))
        self.huge_rows[row] = want

    def settle(self) -> None:
        """Wait until the first chunks advised so far are collapsed into huge pages."""
        for thread in self._collapsing:
            thread.join()
        self._collapsing = []

    def copy_row(self, dst: int, src: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` positions (every layer) to row ``dst``."""
        self.advise_row(dst, length)
        full, rest = divmod(length, self.layout.chunk)
        whole = self.whole
        whole[dst, :full] = whole[src, :full]
        if rest:
            whole[dst, full, :, :, :rest] = whole[src, full, :, :, :rest]


def positions(layer: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """The first ``length`` positions of a layer's first ``rows`` rows, as
    ``[2, rows, kv_heads, length, head_dim]`` (a view where the rows are one chunk)."""
    _, _, _, heads, chunk, dim = layer.shape
    used = -(-length // chunk)
    if used == 1:
        return layer[:, :rows, 0, :, :length]
    dense = layer[:, :rows, :used].permute(0, 1, 3, 2, 4, 5)
    return dense.reshape(2, rows, heads, used * chunk, dim)[:, :, :, :length]


def write_positions(layer: torch.Tensor, rows: slice, start: int, kv: torch.Tensor) -> None:
    """Write ``kv`` [2, len(rows), kv_heads, length, head_dim] at positions
    ``start .. start + length`` of a layer's ``rows``."""
    chunk = layer.shape[4]
    length = kv.shape[3]
    at = start
    while at < start + length:
        c, offset = divmod(at, chunk)
        n = min(chunk - offset, start + length - at)
        layer[:, rows, c, :, offset : offset + n] = kv[:, :, :, at - start : at - start + n]
        at += n


@dataclass(frozen=True)
class Geometry:
    """A mirror layer as the kernels address it (sizes in bytes; see ``mirror_at`` in
    ``cpu_kernels.c``)."""

    k: int  # address of row 0's K
    v: int  # and V
    row_stride: int
    chunk: int  # positions from one KV head's run to the next within a chunk
    chunk_stride: int
    capacity: int  # positions a row holds


def geometry(layer: torch.Tensor) -> Geometry:
    """The kernels' view of a mirror layer: ``[2, rows, chunks, kv_heads, chunk,
    head_dim]`` (a :class:`MirrorMemory` layer), or a dense ``[2, rows, kv_heads, capacity,
    head_dim]`` with contiguous positions."""
    if layer.dim() == 5:
        layer = layer.unsqueeze(2)
    size = layer.element_size()
    _, _, chunks, _, chunk, dim = layer.shape
    if layer.stride(5) != 1 or layer.stride(4) != dim or layer.stride(3) % dim:
        raise ValueError("a decode-mirror layer's positions must lie side by side")
    base = layer.data_ptr()
    return Geometry(
        k=base,
        v=base + layer.stride(0) * size,
        row_stride=layer.stride(1) * size,
        chunk=layer.stride(3) // dim,
        chunk_stride=layer.stride(2) * size if chunks > 1 else 0,
        capacity=chunks * chunk,
    )
