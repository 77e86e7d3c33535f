"""The ``gguf_triton`` linear method: quantized projections kept in their blocks on a GPU and
multiplied by Triton kernels (``block_kernels``).

It takes what the CPU's ``gguf`` method takes, in the same :class:`BlockWeight` layout:
GGUF's Q8_0, Q4_0, Q4_1 and Q4_K (as 4-bit blocks of 32 with float32 scales and offsets,
where the CPU keeps Q4_K's scales per super-block), the 4-bit groups of AWQ / GPTQ
checkpoints, and, with ``model.quantization: int8``, a float projection quantized here to int8
per output channel. Q5_K and Q6_K arrive de-quantized (the weight loader's path for formats a
method does not name) and compute in the model's dtype, as does a fused layer with a shard in
such a format.

Every product, of any row count, runs in the kernel, which de-quantizes the blocks tile by
tile in registers: a decode step reads 5 or 6 bits a weight (4-bit blocks with their scales)
or 9 (8-bit) instead of 16, and a prefill chunk's product (tiles of 128 rows) never writes
the weight out in a float dtype, which would move more bytes than a half copy of the weight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.block_formats.parts import dequantized_part, per_channel_q8, unpacked
from enginecore.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
    UnquantizedLinearMethod,
    quantized_shard_rows,
)
from enginecore.layers.quantized import INT4_BLOCKS, QuantizedTensor
from enginecore.layers.weights import set_weight_attrs

BLOCKS_ATTR = "gguf_blocks"  # layer attribute: [(first output row, BlockWeight)], row order
_PARTS = "_gguf_parts"  # while loading: {first output row: BlockWeight}


def _triton_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"the triton package is not importable ({exc})"
    return None


class GGUFTritonLinearMethod(UnquantizedLinearMethod):
    name = "gguf_triton"
    # Chosen through model.quantization (GGUF files, AWQ / GPTQ, int8) on CUDA, never for a
    # float model by ``auto``: below ``unquantized``.
    priority = -1
    devices = ("cuda",)
    gguf_formats = (*gguf_blocks.FORMATS, "Q4_K", INT4_BLOCKS)

    @classmethod
    def unsupported_reason(cls, device: str, dtype: str) -> str | None:
        # On CPU only under Triton's interpreter: for tests, far too slow to serve.
        interpreted = device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if not interpreted and (reason := super().unsupported_reason(device, dtype)):
            return reason  # told before importing triton (0.1 s)
        return _triton_missing()

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        if not isinstance(layer, LinearBase):
            raise TypeError(f"{self.name} makes the weights of linear layers, not {layer!r}")
        # The float weight is made only when a float shard arrives: a layer loaded as blocks
        # never holds it, so loading a quantized model does not peak at the float model's
        # size. Until then the parameter is one element seen at the weight's shape.
        weight = nn.Parameter(
            torch.empty(1, dtype=dtype).expand(output_size, input_size), requires_grad=False
        )
        layer.weight = weight
        float_loader = layer.weight_loader

        def weight_loader(param: torch.Tensor, loaded: Any, shard: Any = None) -> None:
            if isinstance(loaded, QuantizedTensor):
                self._load_blocks(layer, param, loaded, shard, float_loader)
                return
            _materialize(layer)
            if shard is None:
                float_loader(param, loaded)
            else:
                float_loader(param, loaded, shard)

        set_weight_attrs(weight, {"weight_loader": weight_loader})

    def _load_blocks(
        self,
        layer: LinearBase,
        param: torch.Tensor,
        loaded: QuantizedTensor,
        shard: Any,
        float_loader: Callable[..., None],
    ) -> None:
        if isinstance(layer, RowParallelLinear) and layer.parallel.tp_size > 1:
            # A split of the input dimension cuts through blocks' rows: keep it in float.
            _materialize(layer)
            float_loader(param, dequantized_part(unpacked(loaded)))
            return
        for first, piece in quantized_shard_rows(layer, loaded, shard):
            part = block_weight(piece)
            if part is None:
                raise ValueError(f"{piece.format} blocks are not multiplied by {self.name}")
            layer.__dict__.setdefault(_PARTS, {})[first] = _on(part, param.device)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not isinstance(layer, LinearBase):
            return  # an LM head (the embedding's table) stays in the model's dtype
        parts: dict[int, BlockWeight] = layer.__dict__.pop(_PARTS, {})
        layer.__dict__.pop(BLOCKS_ATTR, None)  # blocks of an earlier load
        weight = layer.weight
        if parts and sum(p.shape[0] for p in parts.values()) == layer.output_size:
            setattr(layer, BLOCKS_ATTR, _merged(parts))
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
            return
        _materialize(layer)
        if parts:
            # Some shards came in float (a format kept de-quantized): the layer computes in
            # the model's dtype.
            for first, part in parts.items():
                weight.data[first : first + part.shape[0]] = dequantized_part(part).to(weight.dtype)
        elif self._int8_wanted(layer):
            setattr(layer, BLOCKS_ATTR, [(0, _on(per_channel_q8(weight.data), weight.device))])
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def _int8_wanted(self, layer: nn.Module) -> bool:
        """``model.quantization: int8``: a float projection becomes int8 per channel."""
        return (
            self.config is not None
            and self.config.model.quantization == "int8"
            and isinstance(layer, ColumnParallelLinear | RowParallelLinear)
            and layer.weight.dim() == 2
            and layer.weight.numel() > 0
            and layer.weight.shape[1] % gguf_blocks.BLOCK == 0
        )

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        blocks = getattr(layer, BLOCKS_ATTR, None)
        if blocks is None:
            return super().apply(layer, x, bias)
        return blocks_linear(blocks, x, bias)


def block_weight(tensor: QuantizedTensor) -> BlockWeight | None:
    """A checkpoint's quantized tensor as the kernels' :class:`BlockWeight` (Q4_K as 4-bit
    blocks of 32 with float32 scales), or None for a format they do not multiply."""
    part = unpacked(tensor)
    if isinstance(part, KQuantWeight):
        return kquant_blocks.four_bit_blocks(part) if part.fmt == "Q4_K" else None
    return part


def blocks_linear(
    blocks: list[tuple[int, BlockWeight]], x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` for W given as row ranges of blocks, in ``x``'s dtype."""
    from enginecore_gpu import block_kernels

    k = blocks[0][1].shape[1]
    n = sum(part.shape[0] for _, part in blocks)
    rows = x.reshape(-1, k)
    out = torch.empty((rows.shape[0], n), dtype=rows.dtype, device=rows.device)
    for first, part in blocks:
        target = out[:, first : first + part.shape[0]]
        block_kernels.block_linear(rows, part.bits, part.qs, part.d, part.m, target)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], n)


def _materialize(layer: LinearBase) -> None:
    """Give the float weight its own memory where it is still the one-element placeholder
    (or was dropped for blocks, before a reload)."""
    weight = layer.weight
    shape = (layer.output_size, layer.input_size)
    if tuple(weight.shape) != shape or weight.stride() == (0, 0):
        weight.data = torch.zeros(shape, dtype=weight.dtype, device=weight.device)


def _on(part: BlockWeight, device: torch.device) -> BlockWeight:
    """``part`` on ``device``; 8-bit blocks keep one zero for their offsets, not one a block."""
    m = part.m if part.bits == 4 else part.d.new_zeros(())
    return BlockWeight(
        part.bits,
        part.qs.to(device).contiguous(),
        part.d.to(device).contiguous(),
        m.to(device).contiguous(),
        part.shape,
    )


def _merged(parts: dict[int, BlockWeight]) -> list[tuple[int, BlockWeight]]:
    """Adjacent row ranges of one kind of block joined, so the kernel runs once for them."""
    merged: list[tuple[int, BlockWeight]] = []
    for first in sorted(parts):
        part = parts[first]
        if merged and merged[-1][1].kind == part.kind and merged[-1][1].d.dtype == part.d.dtype:
            start, prev = merged[-1]
            merged[-1] = (
                start,
                BlockWeight(
                    part.bits,
                    torch.cat([prev.qs, part.qs]),
                    torch.cat([prev.d, part.d]),
                    torch.cat([prev.m, part.m]) if part.bits == 4 else part.m,
                    (prev.shape[0] + part.shape[0], part.shape[1]),
                ),
            )
        else:
            merged.append((first, part))
    return merged
