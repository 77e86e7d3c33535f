"""Phi-3: the Llama block with the checkpoint's projections already fused (``qkv_proj``,
``gate_up_proj``, loaded as whole tensors and split per rank) and LongRoPE scaling (see
``rotary.py``)."""

from __future__ import annotations

from enginecore.layers.decode_block import DecodeBlock, declares_block
from enginecore_models.models.llama import LlamaForCausalLM


@declares_block(DecodeBlock.LLAMA)  # Llama's forward, unchanged: the fused step may run it
class Phi3ForCausalLM(LlamaForCausalLM):
    """Same modules and parameter names as Llama's fused ones: only the registered
    architecture differs."""
