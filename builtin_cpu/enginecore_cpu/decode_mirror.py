"""A dense mirror of the decode batch's K/V, so steady-state decode attention copies nothing.

Paged attention in plain torch has to gather every decode request's blocks into a padded
tensor each step and layer: on CPU that memcpy of the whole context is most of a decode
step. The mirror keeps, per layer, ``[2, rows, chunks, kv_heads, chunk, head_dim]`` with
one row per decoding request: a row's positions in chunks of whole 2 MiB pages, advised
into huge pages as the row grows (``mirror_layout``). A request that keeps decoding only
appends one position per step; its context is copied from the paged cache once, when it
starts decoding. The
paged cache stays the source of truth (prefix caching, preemption, connectors); the
mirror is a per-runner acceleration, dropped whenever anything about a row is in doubt.

Rows are kept compact (``0..n-1`` in batch order): a request that leaves the decode
batch is swap-removed, new ones are appended.

On CPU with float32 queries the fused ``decode_attention`` kernel attends each row over
its own length (the mirror in the KV cache's dtype: float32, float16 or bfloat16);
otherwise SDPA attends every row over the longest, with a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat

import numpy as np
import torch
import torch.nn.functional as F

from enginecore.layers.attention_masks import decode_mask
from enginecore_cpu import cpu_kernels
from enginecore_cpu.mirror_layout import MirrorLayout, MirrorMemory, positions, write_positions

_T_ALIGN = 64  # capacity grows in steps of this many positions


@dataclass
class MirrorStep:
    """What one step's decode attention needs from the mirror."""

    num_rows: int
    write_pos: torch.Tensor  # [n] position of this step's token in each row
    kv_len: int  # positions to attend over (max context + 1)
    lens: torch.Tensor  # [n] int64: each row's positions after this step's write
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    biases: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _write_index: torch.Tensor | None = None

    def write_index(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's index, chunk and position in its chunk of this step's K/V (the torch
        path's indexed write; the fused kernel takes ``lens``). Built once per step."""
        if self._write_index is None:
            rows = torch.arange(self.num_rows, device=self.write_pos.device)
            self._write_index = torch.stack((rows, self.write_pos // chunk, self.write_pos % chunk))
        index = self._write_index
        return index[0], index[1], index[2]

    def mask_for(self, window: int | None) -> torch.Tensor:
        """[n, 1, 1, kv_len], True = attend: each row's positions up to its own, the last
        ``window`` of them when given (torch path only: the fused kernel takes ``lens``)."""
        mask = self.window_masks.get(window)
        if mask is None:
            # each row's query sits at its write position
            mask = decode_mask(self.write_pos[:, None], self.kv_len, window)
            self.window_masks[window] = mask
        return mask

    def bias_for(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias (0 or -inf), built once per step and window: SDPA
        gives the same result with it and runs 3-15% faster than with the bool mask."""
        bias = self.biases.get(window)
        if bias is None:
            mask = self.mask_for(window)
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            bias = self.biases[window] = bias.masked_fill_(~mask, float("-inf"))
        return bias


class DecodeMirror:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_bytes: int,
        max_len: int,
        max_rows: int,
    ) -> None:
        self.num_layers = num_layers
        self.shape_hd = (num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.max_bytes = max_bytes
        self.max_len = max_len
        self.max_rows = max_rows
        self.layers: list[torch.Tensor] = []
        self.memory: MirrorMemory | None = None
        self.layer_of: dict[int, int] = {}  # kv cache data_ptr -> layer index
        self.rows: list[str] = []  # request id of each row
        self.row_of: dict[str, int] = {}
        # Positions valid in each row, as a list (edited when rows leave or join) or as
        # the array the last plan left (one of them None): converting between the two
        # every step would cost more than the rest of a steady plan.
        self._row_len_list: list[int] | None = []
        self._row_len_array: np.ndarray | None = None
        self.step: MirrorStep | None = None
        # Two (positions, lengths, rows, their tensors) buffers for the steps' tensors.
        self._step_buffers: list[
            tuple[np.ndarray, np.ndarray, int, tuple[torch.Tensor, torch.Tensor] | None] | None
        ] = [None, None]
        self._step_buffer = 0

    @property
    def row_len(self) -> list[int]:
        """Positions valid in each row (a copy where the last plan left an array)."""
        if self._row_len_list is not None:
            return self._row_len_list
        assert self._row_len_array is not None  # one of the two is kept
        lengths: list[int] = self._row_len_array.tolist()
        return lengths

    def _lengths_to_edit(self) -> list[int]:
        """``row_len`` as the list that rows leaving or joining edit in place."""
        if self._row_len_list is None:
            self._row_len_list = self.row_len
        self._row_len_array = None
        return self._row_len_list

    # --- capacity -----------------------------------------------------------------------

    def _capacity(self) -> tuple[int, int]:
        if not self.layers:
            return 0, 0
        _, rows, chunks, _, chunk, _ = self.layers[0].shape
        return rows, chunks * chunk

    def _layout(self, rows: int, length: int) -> MirrorLayout:
        """In chunks of huge pages where they fit the memory bound, else dense."""
        h, d = self.shape_hd
        layout = MirrorLayout.plan(self.num_layers, h, d, self.dtype, rows, length)
        if layout.nbytes > self.max_bytes:
            layout = MirrorLayout.plan(self.num_layers, h, d, self.dtype, rows, length, True)
        return layout

    def _bytes(self, rows: int, length: int) -> int:
        """The memory of a mirror of ``rows`` rows holding ``length`` positions each."""
        return self._layout(rows, length).nbytes

    def _ensure(self, rows: int, length: int) -> bool:
        cap_r, cap_t = self._capacity()
        if rows <= cap_r and length <= cap_t:
            return True
        full_r, full_t = self.max_rows, -(-self.max_len // _T_ALIGN) * _T_ALIGN
        if rows <= full_r and self._bytes(full_r, full_t) <= self.max_bytes:
            # Room for every row at full length: allocate it once. Pages are zero-mapped
            # on first touch, so only the positions actually written take memory, and
            # the mirror never regrows (a regrowth copies every row, ~100 ms at 256 rows).
            new_r, new_t = full_r, full_t
        else:
            new_r = max(rows, cap_r, 8)
            if rows > cap_r:
                new_r = max(rows, 2 * cap_r)
            new_t = max(cap_t, -(-length // _T_ALIGN) * _T_ALIGN)
            if length > cap_t:
                new_t = min(max(new_t, 2 * cap_t), full_t)
                new_t = max(new_t, length)
            if self._bytes(new_r, new_t) > self.max_bytes:
                new_r, new_t = max(rows, cap_r), max(length, cap_t)
                if self._bytes(new_r, new_t) > self.max_bytes:
                    return False
        layout = self._layout(new_r, new_t)
        if self.device.type != "cpu":  # no pages to advise: one dense chunk
            h, d = self.shape_hd
            shape = (2, new_r, 1, h, layout.capacity, d)
            grown = [
                torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ]
            memory = None
        else:
            memory = MirrorMemory(layout, self.dtype)
            grown = memory.layers
        keep = len(self.rows)
        if keep and self.layers:
            lengths = self.row_len
            if memory is not None:
                for row, length in enumerate(lengths):
                    memory.advise_row(row, length)
            used = max(lengths, default=0)
            for old, new in zip(self.layers, grown, strict=True):
                if used:
                    write_positions(new, slice(0, keep), 0, positions(old, keep, used))
        self.layers, self.memory = grown, memory
        return True

    def allocate_every_row(self) -> None:
        """Allocate every row at full length now, where the memory bound allows, so that
        the mirror never regrows. Nothing is faulted in: a row's pages come in as its
        request's context is first copied there, and whatever a start faulted in ahead
        (the first positions of every row) a single stream never used."""
        self._ensure(self.max_rows, self.max_len)

    def reset(self) -> None:
        self.layers, self.memory = [], None
        self.rows, self.row_of, self._row_len_list = [], {}, []
        self._row_len_array = None
        self.step = None

    # --- per step -----------------------------------------------------------------------

    def plan(
        self,
        decodes: list[str],
        lens: np.ndarray,
        block_ids: Callable[[str], Sequence[int]],
        kv_caches: list[torch.Tensor],
    ) -> list[str] | None:
        """Order this step's decode requests by row, filling rows for newcomers.

        ``lens`` holds each decode's context length, in ``decodes`` order (int64);
        ``block_ids`` gives a request's blocks (read for newcomers only). Returns the
        decode order, or None when the mirror cannot hold the batch (the caller then uses
        plain paged attention for this step).
        """
        self.step = None
        # A row is reusable only if it holds exactly the request's context so far.
        row_len = self._row_len_array
        if row_len is None:
            row_len = np.asarray(self.row_len, np.int64)
        # The decodes in the rows' order (the order the last plan returned): when every
        # length follows, the step is the rows as they are, checked by two C-level passes.
        if decodes == self.rows and bool((lens == row_len).all()):
            return self._step_over(lens, int(lens.max()) + 1 if len(lens) else 1, kv_caches)
        # Otherwise by request id (a request not decoding this step has no length here:
        # -1 matches no row). The passes over the rows run in C (map over the dicts): a
        # Python loop per row would be most of this plan's cost at hundreds of rows.
        context_lens = dict(zip(decodes, lens.tolist(), strict=True))
        held = np.fromiter(
            map(context_lens.get, self.rows, repeat(-1)), np.int64, count=len(self.rows)
        )
        stale = np.flatnonzero(held != row_len).tolist()
        self._remove_rows(stale)
        # Every row left is a decode of this step: as many rows as decodes, no newcomer.
        newcomers = (
            list(filterfalse(self.row_of.__contains__, decodes))
            if len(self.rows) != len(decodes)
            else []
        )
        n = len(self.rows) + len(newcomers)
        kv_len = int(lens.max()) + 1
        if not self._ensure(n, kv_len):
            self.reset()
            return None
        if newcomers:
            self._fill(newcomers, context_lens, block_ids, kv_caches)
        if stale or newcomers:
            ordered = np.fromiter(map(context_lens.__getitem__, self.rows), np.int64, count=n)
        else:  # the same rows as the last step: their lengths were read above
            ordered = held
        return self._step_over(ordered, kv_len, kv_caches)

    def _step_over(
        self, lens: np.ndarray, kv_len: int, kv_caches: list[torch.Tensor]
    ) -> list[str] | None:
        """The step over the rows as they are, ``lens`` their context lengths in row
        order: each row gets one position."""
        if not self._ensure(len(self.rows), kv_len):
            self.reset()
            return None
        self.layer_of = {cache.data_ptr(): i for i, cache in enumerate(kv_caches)}
        after = lens + 1  # each row's length after this step's token is written
        self._advise(after)
        self._row_len_list, self._row_len_array = None, after
        write_pos, lens_t = self._step_tensors(lens, after)
        self.step = MirrorStep(
            num_rows=len(self.rows), write_pos=write_pos, kv_len=kv_len, lens=lens_t
        )
        return list(self.rows)

    def _step_tensors(
        self, lens: np.ndarray, after: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``lens`` and ``after`` as tensors for the step. On a CPU they are copied into
        two pairs of buffers used in turn (the last step's stay intact), whose tensors
        are the same objects while the row count repeats: a tensor made and freed each
        step gives up the interpreter lock twice, which under async scheduling lets the
        engine's thread hold it while the step waits."""
        if self.device.type != "cpu":
            return torch.from_numpy(lens).to(self.device), torch.from_numpy(after).to(self.device)
        n = len(lens)
        i = self._step_buffer = 1 - self._step_buffer
        held = self._step_buffers[i]
        if held is None or held[0].shape[0] < n:
            size = max(n, self.max_rows)
            arrays = (np.zeros(size, np.int64), np.zeros(size, np.int64))
            held = self._step_buffers[i] = (*arrays, -1, None)
        pos_array, len_array, rows, tensors = held
        pos_array[:n] = lens
        len_array[:n] = after
        if rows != n or tensors is None:
            tensors = (torch.from_numpy(pos_array[:n]), torch.from_numpy(len_array[:n]))
            self._step_buffers[i] = (pos_array, len_array, n, tensors)
        return tensors

    def _advise(self, lengths: np.ndarray) -> None:
        """Advise into huge pages the chunks that rows of ``lengths`` (in row order) have
        grown into, before they are written (one comparison per row a step)."""
        memory = self.memory
        if memory is None or not memory.layout.huge:
            return
        grown = memory.layout.huge_chunks(lengths) > memory.huge_rows[: len(lengths)]
        for row in np.flatnonzero(grown).tolist():
            memory.advise_row(row, int(lengths[row]))

    def _remove_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        row_len = self._lengths_to_edit()
        moves = []  # (hole, moved row, its length)
        for r in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            del self.row_of[self.rows[r]]
            if r != last:  # move the last row into the hole
                self.rows[r] = self.rows[last]
                row_len[r] = row_len[last]
                self.row_of[self.rows[r]] = r
                moves.append((r, last, row_len[r]))
            self.rows.pop()
            row_len.pop()
        # Sequential moves may chain (a moved row moved again); apply them in order. Only
        # the valid positions move: the rest of a row is never attended to.
        for dst, src, length in moves:
            if self.memory is not None:
                self.memory.copy_row(dst, src, length)
            else:
                for layer in self.layers:
                    moved = positions(layer[:, src:], 1, length)
                    write_positions(layer, slice(dst, dst + 1), 0, moved)

    def _fill(
        self,
        newcomers: list[str],
        context_lens: dict[str, int],
        block_ids: Callable[[str], Sequence[int]],
        kv_caches: list[torch.Tensor],
    ) -> None:
        row_len = self._lengths_to_edit()
        start = len(self.rows)
        for rid in newcomers:
            self.row_of[rid] = len(self.rows)
            self.rows.append(rid)
            row_len.append(context_lens[rid])
        longest = max(context_lens[rid] for rid in newcomers)
        if longest == 0:
            return
        if self.memory is not None:  # huge pages before the context is written
            for row in range(start, len(self.rows)):
                self.memory.advise_row(row, row_len[row] + 1)
        block_size = kv_caches[0].shape[2]
        nb = -(-longest // block_size)
        table = torch.zeros((len(newcomers), nb), dtype=torch.int64)
        for i, rid in enumerate(newcomers):
            ids = block_ids(rid)[:nb]
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        kernels = cpu_kernels.kv_kernels_for(kv_caches[0])
        if kernels is not None and kv_caches[0].dtype == self.dtype:
            # One pass per layer straight from the cache's blocks into the rows, on every
            # torch thread: the torch path below gathers the blocks into a temporary, then
            # copies that strided into the rows.
            lens = torch.tensor([context_lens[rid] for rid in newcomers], dtype=torch.int64)
            for cache, layer in zip(kv_caches, self.layers, strict=True):
                kernels.mirror_fill(layer, cache, table, lens, start)
            return
        flat = table.reshape(-1).to(self.device)
        rows = slice(start, start + len(newcomers))
        for cache, layer in zip(kv_caches, self.layers, strict=True):
            _, num_blocks, bs, h, d = cache.shape
            kv = cache.view(2, num_blocks, bs * h * d).index_select(1, flat)
            kv = kv.view(2, len(newcomers), nb * bs, h, d)[:, :, :longest].transpose(2, 3)
            write_positions(layer, rows, 0, kv)

    # --- attention --------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """Decode attention for the first ``num_rows`` tokens (one per row, in row order)."""
        step = self.step
        assert step is not None  # set for the step being run
        layer = self.layers[self.layer_of[kv_cache.data_ptr()]]
        n = step.num_rows
        h, d = layer.shape[3], layer.shape[5]
        kernels = cpu_kernels.kv_kernels_for(layer, query, key, value)
        if kernels is not None and cpu_kernels.heads_contiguous(key, value):
            kernels.mirror_append(layer, key, value, step.lens)
        else:
            rows, chunks, at = step.write_index(layer.shape[4])
            # [rows, chunks, chunk, kv_heads, head_dim]: a row's token at (chunk, at)
            for half, new in ((layer[0], key), (layer[1], value)):
                new = new.reshape(n, h, -1).to(layer.dtype)
                half.permute(0, 1, 3, 2, 4)[rows, chunks, at] = new
        if (
            kernels is not None
            and cpu_kernels.heads_contiguous(query)
            and cpu_kernels.decode_attention_fits(query.shape[1] // h, d)
        ):
            # Each row over its own length: SDPA would attend every row over the longest.
            return kernels.decode_attention(query, layer, step.lens, scale, window)
        kv = positions(layer, n, step.kv_len)
        k, v = kv[0].to(query.dtype), kv[1].to(query.dtype)
        hq, d = query.shape[1], query.shape[2]
        hkv = k.shape[1]
        g = hq // hkv
        q = query.view(n, hkv, g, d)  # the G query heads of a KV head share its keys
        bias = step.bias_for(window, query.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        return out.reshape(n, hq, d)
