"""The ``triton`` attention backend: paged attention that reads K and V in place.

One kernel family (``triton_kernels``) serves the whole mixed batch: decodes, fresh
prompts, prefills after a context and speculative verification, with GQA, sliding
windows and soft-capping. Nothing is gathered into a dense copy, so the workspace does
not grow with the longest context (only the split-KV partials of long decodes).

The per-step metadata lives in persistent device buffers sized once for the largest
step (tokens, requests, blocks per request) and refilled from double-buffered pinned host
staging with non-blocking copies (``enginecore.staging``: a host buffer is rewritten only
once the copy that read it has run): the same addresses every step, which is what lets
the GPU runner replay a captured CUDA graph on new batches.

On NVIDIA and AMD GPUs it is chosen by ``auto``. On CPU it runs only when selected by
name under ``TRITON_INTERPRET=1`` (Triton's interpreter: for tests, far too slow to serve).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from enginecore.interfaces import AttentionBackend, AttentionCapabilities, AttentionSpec
from enginecore.layers.attention import Attention, AttentionBatch
from enginecore.staging import DeviceEvents, StagingBuffer


def _triton_importable() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"the triton package is not importable ({exc})"
    return None


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    capabilities = AttentionCapabilities(devices=("cuda",), cuda_graphs=True)
    priority = 20

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, *, by_name: bool = False) -> str | None:
        kv_reason = cls.capabilities.kv_cache_reason(spec)
        if kv_reason is not None:  # its kernels read and write the model's dtype
            return kv_reason
        device = getattr(spec.device, "type", str(spec.device))
        interpreted = device == "cpu" and by_name and os.environ.get("TRITON_INTERPRET") == "1"
        if device == "cpu" and not interpreted:  # told before importing triton (0.1 s)
            return "runs on cuda (on CPU only by name, under TRITON_INTERPRET=1)"
        missing = _triton_importable()
        if missing is not None:
            return missing
        if interpreted:
            return None  # Triton's interpreter: only when asked for by name
        return super().unsupported_reason(spec, by_name=by_name)

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        from enginecore_attention import triton_kernels

        self.kernels = triton_kernels
        dev = torch.device(spec.device)
        max_tokens = max(spec.max_num_batched_tokens, spec.max_num_seqs)
        max_blocks = -(-spec.max_model_len // spec.block_size) + 1
        events = DeviceEvents(dev)
        self._qsl = StagingBuffer((spec.max_num_seqs + 1,), torch.int32, dev, events)
        self._seq_lens = StagingBuffer((spec.max_num_seqs,), torch.int32, dev, events)
        # One slot mapping and block table per KV cache group: a step's groups' metadata
        # are all alive during its forward.
        self._slots = [
            StagingBuffer((max_tokens,), torch.int64, dev, events)
            for _ in range(spec.num_kv_cache_groups)
        ]
        self._tables = [
            StagingBuffer((spec.max_num_seqs, max_blocks), torch.int32, dev, events)
            for _ in range(spec.num_kv_cache_groups)
        ]

    def build_metadata(self, batch: AttentionBatch) -> TritonMetadata:
        seq_lens = batch.seq_lens
        group = batch.kv_cache_group
        return TritonMetadata(
            slot_mapping=self._slots[group].fill(batch.slot_mapping),
            query_start_loc=self._qsl.fill(batch.query_start_loc),
            seq_lens=self._seq_lens.fill(seq_lens),
            block_table=self._tables[group].fill(batch.block_table),
            max_query_len=int(batch.query_lens.max()) if len(seq_lens) else 0,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
        )

    def forward(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: Any,
    ) -> torch.Tensor:
        if kv_cache is None:
            return self._attend_without_cache(layer, query, key, value, metadata)
        self.kernels.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        self.kernels.paged_attention(
            query,
            kv_cache,
            out,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_table=metadata.block_table,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            logits_soft_cap=layer.logits_soft_cap,
        )
        return out

    def lora_kernels(self) -> Any:
        from enginecore_attention.triton_lora import TritonLoRAKernels

        return TritonLoRAKernels()

    def _attend_without_cache(
        self,
        layer: Attention,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_lens: list[int],
    ) -> torch.Tensor:
        """The profiling pass: the prompts written to a scratch cache just large enough,
        then the same kernel, so the profile sees the kernel's own memory."""
        s, dev = self.spec, query.device
        bs = s.block_size
        blocks = [-(-n // bs) for n in query_lens]
        cache = torch.empty(
            (2, sum(blocks), bs, s.num_kv_heads, s.head_dim), dtype=key.dtype, device=dev
        )
        table = np.zeros((len(query_lens), max(blocks)), dtype=np.int64)
        start = 0
        for r, n in enumerate(blocks):
            table[r, :n] = np.arange(start, start + n)
            start += n
        q = np.asarray(query_lens, dtype=np.int64)
        req_of_token = np.repeat(np.arange(len(q)), q)
        positions = np.arange(int(q.sum())) - (np.cumsum(q) - q)[req_of_token]
        slots = table[req_of_token, positions // bs] * bs + positions % bs
        qsl = np.concatenate(([0], np.cumsum(q)))
        meta = TritonMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(q.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(table.astype(np.int32)).to(dev),
            max_query_len=int(q.max()),
            max_seq_len=int(q.max()),
        )
        return self.forward(layer, query, key, value, cache, meta)
