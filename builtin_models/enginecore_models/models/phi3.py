"""Phi-3: the Llama block with the checkpoint's projections already fused (``qkv_proj``,
``gate_up_proj``, loaded as whole tensors and split per rank) and LongRoPE scaling (see
``rotary.py``)."""

from __future__ import annotations

from enginecore_models.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Same modules and parameter names as Llama's fused ones: only the registered
    architecture differs."""
