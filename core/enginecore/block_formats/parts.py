"""A quantized weight's block layout, whichever linear method multiplies it: GGUF's files
unpacked, the float weight of a part, and int8 per-channel weights as Q8_0 blocks."""

from __future__ import annotations

import torch

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.layers.quantized import QuantizedTensor

Part = BlockWeight | KQuantWeight


def unpacked(tensor: QuantizedTensor) -> Part:
    """A checkpoint's quantized tensor in the layout the kernels multiply."""
    if tensor.format in kquant_blocks.FORMATS:
        return kquant_blocks.from_gguf(tensor.data, tensor.format, tensor.shape)
    return gguf_blocks.from_gguf(tensor.data, tensor.format, tensor.shape)


def dequantized_part(part: Part) -> torch.Tensor:
    """The float32 weight of ``part``, in torch (any device, no kernels needed)."""
    if isinstance(part, KQuantWeight):
        return kquant_blocks.dequantize(part)
    return gguf_blocks.dequantize(part)


def per_channel_q8(weight: torch.Tensor) -> BlockWeight:
    """``weight`` [out, in] as signed bytes with one scale per output row (max |w| / 127),
    held as Q8_0 blocks whose scales repeat along the row."""
    out, k = weight.shape
    scale = weight.detach().float().abs().amax(dim=1) / 127.0
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    qs = torch.round(weight.float() / safe).clamp(-127, 127).to(torch.int8).contiguous()
    d = scale.unsqueeze(1).expand(out, k // gguf_blocks.BLOCK).contiguous()
    return BlockWeight(8, qs, d, torch.zeros_like(d), (out, k))
