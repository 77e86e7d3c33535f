"""CPU projections through enginecore's own AVX2 GEMM (``ec_gemm`` in cpu_kernels.c).

On a CPU with AVX2 and no AVX-512 (the AMD Zen 3 machine in benchmarks/RESULTS.md), MKL
ran the short-K products of a decode step far below the cores' peak. On 8 rows, a
2,048 x 256 weight took 0.18 ms packed where ``ec_gemm`` takes 0.09, and the 8,192-wide
LM head 2.9 ms where ``ec_gemm`` takes 0.36. The kernel copies each weight once into
panels of 16 output columns, each panel k-major, and runs a 6-row x 16-column tile of
register accumulators over the whole K.

Every output sums its K products in one FMA chain from k = 0 up, then adds its bias, so
a row gets the same bits alone and in any batch; MKL also changes its summation order
for a single row, where it takes its matrix-vector path. The bits are not ``F.linear``'s:
MKL sums in another order, a few units in the last place apart. transformers' own
single-row decode already differs from a batched GEMM in this way, and the greedy tests
compare up to the first near-tie for that reason.

``preferred()`` decides: float32 CPU weights on an AVX2 CPU without AVX-512, with the
kernels built. On AVX-512 CPUs MKL's packed GEMM (``packed_gemm``) keeps the work: this
kernel was not measured there. ``ENGINECORE_PANEL_GEMM=0`` switches it off.
"""

from __future__ import annotations

import torch

from enginecore.builtin_models import cpu_kernels

ENV_SWITCH = "ENGINECORE_PANEL_GEMM"


def preferred() -> bool:
    """Whether projections on this CPU should go through ``ec_gemm``."""
    if cpu_kernels.switched_off(ENV_SWITCH):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    kernels = cpu_kernels.load()
    return kernels is not None and kernels.gemm_available()


def eligible(weight: torch.Tensor) -> bool:
    """A float32 CPU matrix, in either memory layout (packing reads it by strides)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


class PanelWeight:
    """One projection weight (logical [out, in]) packed for ``ec_gemm``."""

    def __init__(self, kernels: cpu_kernels.CpuKernels, weight: torch.Tensor) -> None:
        self.kernels = kernels
        self.n, self.k = weight.shape
        self.panels = kernels.gemm_pack(weight)
        self.source = (weight.data_ptr(), weight._version)

    def accepts(self, rows: int) -> bool:
        return rows >= 1

    def current_for(self, weight: torch.Tensor) -> bool:
        return self.source == (weight.data_ptr(), weight._version)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x`` of shape [..., in]."""
        if x.dtype != torch.float32:  # the kernel reads raw float pointers
            raise TypeError(f"packed float32 projection given {x.dtype} activations")
        rows = x.reshape(-1, self.k)
        if rows.stride(-1) != 1 or rows.stride(0) < self.k:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = self.kernels.gemm(rows, self.panels, self.n, bias)
        return out.view(*x.shape[:-1], self.n)
