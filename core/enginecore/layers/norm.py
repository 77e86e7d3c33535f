"""Normalization layers. RMS norm may run as a backend's fused kernel (``fused_ops``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.layers.fused_ops import NO_FUSED_OPS
from enginecore.layers.weights import default_weight_loader, make_param, set_weight_attrs


class RMSNorm(nn.Module):
    """RMS norm computed in float32 (as the reference does) and cast back before scaling."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), dtype)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})
        self.fused_ops = NO_FUSED_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            out = self.fused_ops.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        # F.rms_norm is one fused kernel (the hand-written form is ~50x slower on CPU).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the residual stream, updated in place where fused) and its
        norm: the reference's ``hidden = residual + hidden; norm(hidden)``."""
        if x.dim() == 2 and residual.stride(-1) == 1:
            out = self.fused_ops.rms_norm(x, self.weight, self.eps, residual)
            if out is not None:
                return out, residual
        residual = residual + x
        return self.forward(residual), residual


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((dim,), dtype)
        self.bias = make_param((dim,), dtype)
        for p in (self.weight, self.bias):
            set_weight_attrs(p, {"weight_loader": default_weight_loader})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
