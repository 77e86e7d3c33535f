"""Registers the CPU backend: the ``cpu`` attention backend and the ``cpu_packed`` linear
method (``auto`` picks both on CPU), and the ``gguf`` linear method (GGUF files keep their
quantized blocks, see ``model.quantization``)."""

from __future__ import annotations

from typing import Any

import enginecore


@enginecore.hookimpl(trylast=True)
def register_attention_backends(registry: Any) -> None:
    registry.add(
        "cpu",
        "enginecore_cpu.attention:CpuAttentionBackend",
        summary="C kernels and a dense decode mirror on top of the torch paths (CPU)",
    )


@enginecore.hookimpl(trylast=True)
def register_linear_methods(registry: Any) -> None:
    registry.add(
        "cpu_packed",
        "enginecore_cpu.linear_method:CpuPackedLinearMethod",
        summary="input-major weights packed for MKL's or enginecore's GEMM (CPU)",
    )
    registry.add(
        "gguf",
        "enginecore_cpu.gguf_linear_method:GGUFLinearMethod",
        summary="GGUF Q8_0/Q4_0/Q4_1 weights kept in their blocks, int8 dot products (CPU)",
    )
