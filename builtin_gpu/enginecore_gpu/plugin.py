"""Registers the GPU backend's ``gguf_triton`` linear method (quantized blocks kept on the
GPU, Triton kernels; chosen through ``model.quantization`` on CUDA)."""

from __future__ import annotations

from typing import Any

import enginecore


@enginecore.hookimpl(trylast=True)
def register_linear_methods(registry: Any) -> None:
    registry.add(
        "gguf_triton",
        "enginecore_gpu.block_linear_method:GGUFTritonLinearMethod",
        summary="GGUF Q8_0/Q4_0/Q4_1/Q4_K, AWQ/GPTQ and int8 blocks kept on the GPU (Triton)",
    )
