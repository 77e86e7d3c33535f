"""The ``cpu_packed`` linear method: projections laid out and packed for this CPU's GEMM.

After loading, each projection's weight is
- stored input-major ([in, out] in memory, same logical shape): ``F.linear`` then hands
  MKL a plain ``x @ W`` instead of ``x @ W^T``, up to 2x faster at decode batch sizes
  (a 16 x 256 x 2048 projection: 63 vs 127 µs) and no slower for prefill chunks. A head
  tied to the embedding keeps the row-major layout the lookup wants;
- for a bfloat16 model on a CPU with AVX512-BF16, kept in bfloat16 and row-major: up to
  ``bf16_gemv.KERNEL_MAX_ROWS`` activation rows (decode steps) enginecore's
  ``vdpbf16ps`` kernel (``bf16_gemv``) reads it, above that torch's bfloat16 ``F.linear``
  (oneDNN, AMX where present), each the faster there;
- for any other bfloat16/float16 model on a CPU without AMX, widened to float32 with the
  same values (``project`` rounds each output back): torch's half-precision GEMM converts
  in software there, and a small model's projections ran 1.03-1.64x faster in float32;
- packed once for MKL's packed GEMM, or for enginecore's own AVX2 GEMM where that is
  preferred (``packed_gemm``), bit-exact with ``F.linear``. A gated gate/up weight packs
  in pairs so the GEMM stores ``silu(gate) * up`` directly.
The copies (float32 widening, packed panels) are made only while their total stays under
a quarter of the memory that was free when loading finished.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import cast

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from enginecore.config import EngineConfig
from enginecore.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from enginecore.layers.linear import MergedColumnParallelLinear, UnquantizedLinearMethod
from enginecore_cpu import bf16_gemv, cpu_kernels, packed_gemm, panel_gemm
from enginecore_cpu.host_memory import keep_freed_memory

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b``. A weight stored wider than the activations computes in its dtype and
    rounds the result back once, as a half-precision GEMM with float32 accumulation does.
    A bfloat16 weight with its inputs contiguous meets few bfloat16 rows in ``bf16_gemv``."""
    if (
        x.dtype == torch.bfloat16 == weight.dtype
        and weight.stride(-1) == 1
        and x.numel() <= bf16_gemv.KERNEL_MAX_ROWS * x.shape[-1]
    ):
        kernel = bf16_gemv.library.serving()  # oneDNN's GEMM while it compiles
        if kernel is not None:
            return kernel.linear(x, weight, bias)
    packed = packed_gemm.packed_for(weight, x)  # a packed copy, where one was made
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias) if packed is None else packed.linear(x, bias)
    wide, bias = weight.dtype, None if bias is None else bias.to(weight.dtype)
    if packed is None:
        return F.linear(x.to(wide), weight, bias).to(x.dtype)
    return packed.linear(x.to(wide), bias).to(x.dtype)


def project_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x``'s [gate | up] projection in one pass, where the weight
    is packed in pairs for enginecore's GEMM; None elsewhere."""
    packed = packed_gemm.packed_for(weight, x)
    if not isinstance(packed, panel_gemm.PanelWeight) or not packed.half:
        return None
    if x.dtype != weight.dtype:  # float32 projections of a half model round in between
        return None
    return packed.silu_and_mul(x, bias)


class CpuPackedLinearMethod(UnquantizedLinearMethod):
    name = "cpu_packed"
    priority = 10
    devices = ("cpu",)

    def __init__(self, config: EngineConfig | None = None) -> None:
        super().__init__(config)
        keep_freed_memory()
        self._budget: int | None = None  # bytes of copies still allowed
        cpu_kernels.build_in_background(*self.kernel_builds())

    def kernel_builds(self) -> list[Callable[[], Path]]:
        """The C libraries a model under this method will load, compiled while its
        weights load (the ``cpu`` attention backend's kernels)."""
        return [] if cpu_kernels.switched_off(cpu_kernels.ENV_SWITCH) else [cpu_kernels.build]

    def _afford(self, nbytes: int) -> bool:
        if self._budget is None:
            self._budget = psutil.virtual_memory().available // 4
        if nbytes > self._budget:
            return False
        self._budget -= nbytes
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        if weight.device.type != "cpu":
            return
        # A head tied to the embedding keeps the rows its lookup wants; a bfloat16 weight
        # for ``bf16_gemv`` keeps the rows the kernel reads (oneDNN's GEMM is as fast so).
        keeps_rows = (
            isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
        ) or (weight.dtype == torch.bfloat16 and bf16_gemv.library.possible())
        if not keeps_rows:
            if (
                weight.dtype in _HALF
                and not cpu_kernels.cpu_has_amx()
                and self._afford(weight.numel() * 2)
            ):
                weight.data = weight.data.float().t().contiguous().t()
            else:
                weight.data = weight.data.t().contiguous().t()
        if isinstance(layer, MergedColumnParallelLinear) and layer.gated:
            setattr(weight, panel_gemm.GATED_HALF, layer.local_sizes[0])
        extra = packed_gemm.packed_bytes([weight])
        if extra and self._afford(extra):
            packed_gemm.pack_weights([weight])

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return project(x, cast(torch.Tensor, layer.weight), bias)

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return project_silu_and_mul(x, cast(torch.Tensor, layer.weight), bias)
