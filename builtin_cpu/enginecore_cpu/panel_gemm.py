"""CPU projections through enginecore's own AVX2 GEMM (``ec_gemm`` in cpu_kernels.c).

On a CPU with AVX2 and no AVX-512, MKL runs the short-K products of a decode step far
below the cores' peak. On 8 rows, a 2,048 x 256 weight takes 0.18 ms packed where
``ec_gemm`` takes 0.09, and an 8,192-wide LM head 2.9 ms where ``ec_gemm`` takes 0.36. The kernel copies each weight once into
panels of 16 output columns, each panel k-major, and runs a 6-row x 16-column tile of
register accumulators over the whole K.

Every output sums its K products in one FMA chain from k = 0 up, then adds its bias, so
a row gets the same bits alone and in any batch; MKL also changes its summation order
for a single row, where it takes its matrix-vector path. The bits are not ``F.linear``'s:
MKL sums in another order, a few units in the last place apart. transformers' own
single-row decode already differs from a batched GEMM in this way, and the greedy tests
compare up to the first near-tie for that reason.

An MLP's fused gate and up weight is packed in pairs (8 gate columns, then the same 8
up columns, per panel): the kernel then stores ``silu(gate) * up`` straight from its
accumulators, with the bits of the GEMM followed by ``silu_and_mul``, and the
[rows, 2 x intermediate] product is never written. At 2,048 rows of the tiny model that
product is 16 MiB per layer, past L2 and most of L3.

``preferred()`` decides: float32 CPU weights on an AVX2 CPU without AVX-512, with the
kernels built. On AVX-512 CPUs MKL's packed GEMM (``packed_gemm``) keeps the work: this
kernel was not measured there. ``ENGINECORE_PANEL_GEMM=0`` switches it off.
"""

from __future__ import annotations

import torch

from enginecore_cpu import cpu_kernels

ENV_SWITCH = "ENGINECORE_PANEL_GEMM"


def preferred() -> bool:
    """Whether projections on this CPU should go through ``ec_gemm``."""
    if cpu_kernels.switched_off(ENV_SWITCH):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    # Not while the library compiles: the weights are packed for MKL (or none) then, and
    # keep that packing once it lands (the same bits as F.linear).
    kernels = cpu_kernels.library.serving()
    return kernels is not None and kernels.gemm_available()


def eligible(weight: torch.Tensor) -> bool:
    """A float32 CPU matrix, in either memory layout (packing reads it by strides)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


# The attribute an MLP sets on its fused gate/up weight (to the intermediate size) when
# its output feeds silu(gate) * up.
GATED_HALF = "silu_gated_half"


def gated_half(weight: torch.Tensor) -> int:
    """The intermediate size of a [gate; up] weight marked by its MLP (``GATED_HALF``),
    where it packs in pairs (a multiple of 8), else 0."""
    half = getattr(weight, GATED_HALF, 0)
    return half if half and half % 8 == 0 and weight.shape[0] == 2 * half else 0


class PanelWeight:
    """One projection weight (logical [out, in]) packed for ``ec_gemm``; a [gate; up]
    weight (``half`` rows each) packed in pairs also gives ``silu(gate) * up``."""

    def __init__(
        self, kernels: cpu_kernels.CpuKernels, weight: torch.Tensor, half: int = 0
    ) -> None:
        self.kernels = kernels
        self.n, self.k = weight.shape
        self.half = half
        self.panels = kernels.gemm_pack(weight, half)
        self.source = (weight.data_ptr(), weight._version)

    def accepts(self, rows: int) -> bool:
        return rows >= 1

    def current_for(self, weight: torch.Tensor) -> bool:
        return self.source == (weight.data_ptr(), weight._version)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T + b`` for float32 ``x`` of shape [..., in]."""
        return self._multiply(x, bias, silu=False)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate) * up`` of ``x W^T + b`` = [gate | up], for a weight packed with
        ``half``: [..., half], bit for bit ``CpuKernels.silu_and_mul`` of ``linear``."""
        if not self.half:
            raise ValueError("silu_and_mul needs a weight packed as [gate; up] (half > 0)")
        return self._multiply(x, bias, silu=True)

    def _multiply(self, x: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
        if x.dtype != torch.float32:  # the kernel reads raw float pointers
            raise TypeError(f"packed float32 projection given {x.dtype} activations")
        rows = x.reshape(-1, self.k)
        if rows.stride(-1) != 1 or rows.stride(0) < self.k:
            rows = rows.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = self.kernels.gemm(rows, self.panels, self.n, bias, self.half, silu)
        return out.view(*x.shape[:-1], out.shape[-1])
