"""The ``flash_attn`` attention backend: the flash-attn package's varlen kernel reading
the paged cache through its block table.

flash-attn takes a paged K/V cache laid out ``[blocks, block_size, kv_heads, head_dim]``,
which is each half of enginecore's cache, so nothing is copied; it needs pages of a
multiple of 256 tokens (``block_size``), half precision and CUDA. With ``block_size``
unset it is given pages of 256 (``default_block_size``); a block size set to anything
else rules it out. Causal masking is aligned to the end of each sequence, which is
enginecore's convention for queries after a context. Chosen by ``auto`` over ``triton``
where all of that holds.
"""

from __future__ import annotations

from typing import Any

import torch

from enginecore.interfaces import AttentionCapabilities, AttentionSpec
from enginecore.layers.attention import Attention
from enginecore_attention.triton_backend import TritonAttentionBackend, TritonMetadata


class FlashAttnBackend(TritonAttentionBackend):
    name = "flash_attn"
    capabilities = AttentionCapabilities(
        devices=("cuda",),
        dtypes=("bfloat16", "float16"),
        head_sizes=tuple(range(8, 257, 8)),
        cuda_graphs=True,
    )
    priority = 30
    default_block_size = 256

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, *, by_name: bool = False) -> str | None:
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            return f"the flash_attn package is not importable ({exc})"
        if spec.block_size % 256:
            return f"needs block_size a multiple of 256 (it is {spec.block_size})"
        return super(TritonAttentionBackend, cls).unsupported_reason(spec, by_name=by_name)

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        from flash_attn import flash_attn_varlen_func

        self.varlen = flash_attn_varlen_func

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
        self.kernels.write_kv(key, value, kv_cache, metadata.slot_mapping)  # skips padding
        return self._attend(layer, query, kv_cache, metadata)

    def _attend(
        self, layer: Attention, query: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMetadata
    ) -> torch.Tensor:
        cu_k = torch.zeros_like(meta.query_start_loc)
        torch.cumsum(meta.seq_lens, 0, out=cu_k[1:])
        window = (-1, -1) if layer.sliding_window is None else (layer.sliding_window - 1, 0)
        out: torch.Tensor = self.varlen(
            query,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=layer.scale,
            causal=True,
            window_size=window,
            softcap=layer.logits_soft_cap or 0.0,
            block_table=meta.block_table,
        )
        return out
