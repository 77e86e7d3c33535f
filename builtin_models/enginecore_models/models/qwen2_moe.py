"""Qwen2-MoE: the Qwen2 block (biased q/k/v) with routed experts plus a shared expert
whose output a sigmoid gate scales."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.layers.moe import Router
from enginecore_models.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from enginecore_models.models.qwen3_moe import is_sparse_layer, qwen_moe_block


class Qwen2MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        block = qwen_moe_block(cfg, parallel, dtype)
        self.gate, self.experts = block.gate, block.experts
        self.shared_expert = LlamaMLP(
            cfg, parallel, dtype, intermediate_size=cfg.shared_expert_intermediate_size
        )
        self.shared_expert_gate = Router(cfg.hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, self.gate(x))
        shared = self.shared_expert(x)
        output: torch.Tensor = routed + F.sigmoid(self.shared_expert_gate(x)) * shared
        return output


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(
        self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype, layer_index: int
    ) -> nn.Module:
        if is_sparse_layer(cfg, layer_index):
            return Qwen2MoeSparseBlock(cfg, parallel, dtype)
        return LlamaMLP(cfg, parallel, dtype)


class Qwen2MoeModel(LlamaModel):
    decoder_layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2MoeModel

    @staticmethod
    def bias_on_qkv_only(hf_config: Any) -> bool:
        return bool(getattr(hf_config, "qkv_bias", True))
