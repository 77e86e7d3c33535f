"""Qwen3: the Llama block with an RMS norm over each query and key head (QK norm)."""

from __future__ import annotations

from typing import Any

import torch

from enginecore.distributed import ParallelContext
from enginecore.layers import RMSNorm
from enginecore.layers.decode_block import DecodeBlock, declares_block, declares_plain_logits
from enginecore_models.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


@declares_block(DecodeBlock.LLAMA_QK_NORM)
class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        cfg: Any,
        parallel: ParallelContext,
        dtype: torch.dtype,
        is_qwen2: bool,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(cfg, parallel, dtype, is_qwen2, sliding_window)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor, t: int) -> torch.Tensor:
        # Heads as rows of a 2-D tensor: the backend's fused norm takes them (the CPU's
        # fused decode step norms them with the same kernel).
        q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim))
        qk = (q.view(t, self.num_heads, -1), k.view(t, self.num_kv_heads, -1))
        return torch.cat(qk, dim=1)  # one rotation for both


@declares_block(DecodeBlock.LLAMA_QK_NORM)
class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


@declares_block(DecodeBlock.LLAMA_QK_NORM)
class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


@declares_block(DecodeBlock.LLAMA_QK_NORM)
@declares_plain_logits
class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
