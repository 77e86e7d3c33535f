"""Registers the device-independent attention backends: ``torch`` (the reference, any
device), ``triton`` (paged attention kernels for NVIDIA and AMD GPUs) and
``flash_attn`` (used when the ``flash_attn`` package is importable)."""

from __future__ import annotations

from typing import Any

import enginecore


@enginecore.hookimpl(trylast=True)
def register_attention_backends(registry: Any) -> None:
    registry.add(
        "torch",
        "enginecore.layers.torch_attention:TorchAttentionBackend",
        summary="SDPA over K/V gathered from the paged cache: any device, the reference",
    )
    registry.add(
        "triton",
        "enginecore_attention.triton_backend:TritonAttentionBackend",
        summary="paged attention kernels reading K/V in place (NVIDIA and AMD GPUs)",
    )
    registry.add(
        "flash_attn",
        "enginecore_attention.flash_attn_backend:FlashAttnBackend",
        summary="the flash_attn package's varlen kernel over the paged cache (when importable)",
    )
