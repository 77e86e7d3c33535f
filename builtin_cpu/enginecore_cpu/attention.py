"""The ``cpu`` attention backend: the torch backend with the C kernels and a dense
decode mirror where they apply.

- K/V are written into the cache by ``ec_write_kv``: float32, or float16 / bfloat16
  (``cache.kv_cache_dtype``) rounded as written; the kernels widen them as they read.
- Decodes are served from a :class:`DecodeMirror`: each decoding request's K/V is kept
  densely, so a steady decode step appends one position instead of gathering the whole
  context; in float32 the fused decode kernel attends each row over its own length.
- Fresh prompts go to the fused prefill kernel where enginecore's own GEMM runs (AVX2
  without AVX-512; ``panel_gemm.preferred``), up to a length (1.7-2x SDPA on prompts of
  32-512 tokens at head dim 64).
- Everything else, and every dtype the kernels do not take, runs the torch paths.

The KV cache is an anonymous mapping (pages cost nothing until touched) whose first
blocks are faulted in on a thread of their own once allocated, not inside the first
batch's steps and not before the engine is ready.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from enginecore.interfaces import AttentionCapabilities, AttentionSpec
from enginecore.layers.attention import Attention, AttentionBatch
from enginecore.layers.torch_attention import (
    AttentionGroup,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from enginecore.layers.torch_attention import write_kv as torch_write_kv
from enginecore_cpu import cpu_kernels, kernel_cache, panel_gemm
from enginecore_cpu.decode_mirror import DecodeMirror
from enginecore_cpu.fused_ops import CpuFusedOps
from enginecore_cpu.host_memory import (
    PREFAULT_BYTES,
    Prefault,
    keep_freed_memory,
    prefault_in_background,
    region,
    release_freed_memory,
    zeroed,
)


def fresh_prompts(group: AttentionGroup, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[first token, length] of every prompt of at most ``max_len`` tokens in a run
    without context, counted from the group's first token."""
    starts: list[int] = []
    lens: list[int] = []
    for run in group.runs:
        if run.context_len == 0 and run.query_len <= max_len:
            end = run.token_start + run.num_reqs * run.query_len
            starts += range(run.token_start, end, run.query_len)
            lens += [run.query_len] * run.num_reqs
    return torch.tensor(starts, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)


def prefault_blocks(spec: AttentionSpec, num_blocks: int) -> int:
    """How many of the KV cache's first blocks to fault in at start-up: those of one
    sequence of the longest length (and the null block before them), at most
    ``PREFAULT_BYTES``. A single stream never writes beyond them; the blocks of further
    sequences are faulted in by the steps that first write them, a small share of those
    steps' time, instead of being held resident from the start whether used or not."""
    s = spec
    itemsize: int = s.cache_dtype.itemsize
    block_bytes = 2 * s.block_size * s.num_kv_heads * s.head_dim * itemsize
    one_sequence = 1 + -(-s.max_model_len // s.block_size)
    return min(num_blocks, one_sequence, PREFAULT_BYTES // max(block_bytes * s.num_layers, 1))


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    # Soft-capped scores are not in the kernels: such models take the torch backend.
    capabilities = AttentionCapabilities(
        devices=("cpu",), logits_soft_cap=False, kv_cache_dtypes=("float16", "bfloat16")
    )
    priority = 10

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        keep_freed_memory()
        self.mirror: DecodeMirror | None = None
        self.prefaulted: Prefault | None = None  # set once the first pages are in
        self._caches: list[torch.Tensor] = []
        self._mirrored = False  # this step's decodes come from the mirror

    def allocate_kv_cache(self, num_blocks: int) -> list[Any]:
        s = self.spec
        shape = self.kv_cache_shape(num_blocks)
        caches = [zeroed(shape, s.cache_dtype, s.device) for _ in range(s.num_layers)]
        # Mirror the decode batch densely, in at most as much memory as the paged cache.
        self.mirror = DecodeMirror(
            s.num_layers,
            s.num_kv_heads,
            s.head_dim,
            s.cache_dtype,
            s.device,
            max_bytes=sum(c.numel() * c.element_size() for c in caches),
            max_len=s.max_model_len,
            max_rows=s.max_num_seqs,
        )
        # Pages are mapped on first touch (1-10 µs per 4 KiB page): the first blocks,
        # which the pool hands out first, are faulted in on a thread of their own, not in
        # the steps, and not before the engine is ready.
        first = prefault_blocks(s, num_blocks)
        starts = [cache[kv, :first] for cache in caches for kv in range(cache.shape[0])]
        if s.num_kv_cache_groups > 1:
            self.mirror = None  # see order_decodes
        else:
            self.mirror.allocate_every_row()

        def touch() -> None:  # without MADV_POPULATE_WRITE: zeros over zeros
            for span in starts:
                span.zero_()

        self.prefaulted = prefault_in_background(caches, [region(span) for span in starts], touch)
        self._caches = caches
        # The last of start-up's allocations: what the load freed goes back to the OS.
        release_freed_memory()
        return caches

    def release_kv_cache(self) -> None:
        if self.prefaulted is not None:  # it holds the memory, and would fault it in
            self.prefaulted.stop()
            self.prefaulted = None
        self.mirror = None
        self._caches = []

    def workspace_bytes(self) -> int:
        return 0  # decodes read the mirror, whose memory is bounded by the cache's

    def order_decodes(
        self, req_ids: list[str], batch_view: Mapping[str, tuple[int, list[int]]]
    ) -> list[str]:
        # A step's first call: libraries that finished compiling serve from here on
        # (also in build_metadata, which steps without decodes reach first).
        cpu_kernels.adopt_landed()
        self._mirrored = False
        # The mirror fills from one block table and keys layers by their cache tensor,
        # which KV cache groups share: grouped models decode from the paged cache.
        if self.mirror is None or not req_ids or self.spec.num_kv_cache_groups > 1:
            return req_ids
        # Block ids are read only for requests new to the mirror (the runner's view gives
        # the context lengths alone, as one array; other views a (length, block ids) pair).
        lens_of = getattr(batch_view, "context_lens_array", None)
        lens = (
            lens_of(req_ids)
            if lens_of is not None
            else np.fromiter((batch_view[r][0] for r in req_ids), np.int64, len(req_ids))
        )
        order = self.mirror.plan(req_ids, lens, lambda r: batch_view[r][1], self._caches)
        if order is None:  # the mirror cannot hold this batch: plain paged attention
            return req_ids
        self._mirrored = True
        return order

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        cpu_kernels.adopt_landed()  # between steps: landed libraries serve from here on
        if not batch.num_decodes:
            self._mirrored = False
        return super().build_metadata(batch)

    def fused_ops(self) -> CpuFusedOps:
        return CpuFusedOps()

    def fused_decode(self, model: Any, kv_caches: list[Any]) -> Any:
        # imported here: the step knows the model classes, which import this package
        from enginecore_cpu import decode_step
        from enginecore_cpu.deferred_decode import DeferredDecodeStep

        def make() -> Any:
            return decode_step.fused_decode_step(model, kv_caches, self)

        off = cpu_kernels.switched_off(decode_step.ENV_SWITCH) or self.mirror is None
        if off or decode_step._lib is not None:
            return make()
        try:
            library = decode_step.build(only_path=True)
        except RuntimeError:  # no compiler: the step says so
            return make()
        if library.exists():
            return make()
        # Still compiling (started while the weights loaded): serve with the layers
        # meanwhile instead of holding up the first token.
        cpu_kernels.build_in_background(kernel_cache.idle(decode_step.build))
        return DeferredDecodeStep(make, library.exists)

    def decodes_mirrored(self) -> bool:
        """Whether this step's decodes are served from the mirror (set by
        ``order_decodes``)."""
        return self._mirrored

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        kernels = cpu_kernels.kv_kernels_for(kv_cache, key, value)
        if (
            kernels is not None
            and cpu_kernels.heads_contiguous(key, value)
            and slot_mapping.dtype == torch.int64
        ):
            kernels.write_kv(kv_cache, key, value, slot_mapping)
        else:
            torch_write_kv(kv_cache, key, value, slot_mapping)

    def attend_decodes(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        if not self._mirrored:
            return super().attend_decodes(layer, query, key, value, kv_cache, metadata)
        assert self.mirror is not None  # a mirrored step has its mirror
        return self.mirror.attend(query, key, value, kv_cache, layer.scale, layer.sliding_window)

    def attend_prefills(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        group: AttentionGroup,
        skip_fresh_up_to: int = 0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        fused_len = 0  # fresh prompts up to this length take the kernel
        kernels = None
        if layer.sliding_window is None:
            kernels = cpu_kernels.kernels_for(query, key, value, out)
        # Where enginecore's GEMM is preferred: the kernel runs on its tile, measured there.
        if (
            kernels is not None
            and cpu_kernels.heads_contiguous(query, key, value)
            and panel_gemm.preferred()
        ):
            fused_len = cpu_kernels.prefill_attention_max_len(kernels, query.shape[-1])
            starts, lens = fresh_prompts(group, fused_len)
            if len(starts):
                kernels.prefill_attention(query, key, value, starts, lens, layer.scale, out)
        return super().attend_prefills(
            layer, query, key, value, kv_cache, group, skip_fresh_up_to=fused_len, out=out
        )
