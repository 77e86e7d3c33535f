"""GPT-2: learned positions, LayerNorm, fused QKV, GELU MLP, LM head tied to the embedding."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.layers import (
    Attention,
    AttentionContext,
    ColumnParallelLinear,
    LayerNorm,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_params,
    vocab_parallel_logits,
)

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}

# HF GPT-2 stores these as Conv1D ([in, out]); our linears are [out, in].
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg.n_embd
        self.head_dim = hidden // cfg.n_head
        scale = self.head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        # GPT-2's fused c_attn is [q; k; v] in one checkpoint tensor: the QKV layer splits
        # it per projection, then per rank (shard=None in its loader).
        self.c_attn = QKVParallelLinear(
            hidden, self.head_dim, cfg.n_head, cfg.n_head, bias=True, parallel=parallel, dtype=dtype
        )
        self.num_heads = self.c_attn.num_heads  # this rank's heads
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True, parallel=parallel, dtype=dtype)
        self.attn = Attention(self.num_heads, self.head_dim, scale)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor | None, ctx: AttentionContext
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.attn(q, k, v, kv_cache, ctx)
        output: torch.Tensor = self.c_proj(out.reshape(t, -1))
        return output


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        inner = getattr(cfg, "n_inner", None) or 4 * cfg.n_embd
        self.c_fc = ColumnParallelLinear(
            cfg.n_embd, inner, bias=True, parallel=parallel, dtype=dtype
        )
        self.c_proj = RowParallelLinear(
            inner, cfg.n_embd, bias=True, parallel=parallel, dtype=dtype
        )
        act = cfg.activation_function
        if act not in _ACTIVATIONS:
            raise NotImplementedError(f"activation_function {act!r} is not supported")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.c_proj(self.act(self.c_fc(x)))
        return output


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = LayerNorm(cfg.n_embd, eps, dtype)
        self.attn = GPT2Attention(cfg, parallel, dtype)
        self.ln_2 = LayerNorm(cfg.n_embd, eps, dtype)
        self.mlp = GPT2MLP(cfg, parallel, dtype)

    def forward(
        self, hidden: torch.Tensor, kv_cache: torch.Tensor | None, ctx: AttentionContext
    ) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, ctx)
        output: torch.Tensor = hidden + self.mlp(self.ln_2(hidden))
        return output


class GPT2Model(nn.Module):
    def __init__(self, cfg: Any, parallel: ParallelContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(
            cfg.vocab_size, cfg.n_embd, parallel=parallel, dtype=dtype
        )
        self.wpe = VocabParallelEmbedding(
            cfg.n_positions, cfg.n_embd, parallel=parallel, dtype=dtype
        )
        self.h = nn.ModuleList(GPT2Block(cfg, parallel, dtype) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            hidden = block(hidden, kv_caches[i] if kv_caches else None, ctx)
        output: torch.Tensor = self.ln_f(hidden)
        return output


class GPT2LMHeadModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        parallel: ParallelContext = SINGLE_RANK,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if parallel.pp_size > 1:
            raise NotImplementedError(
                "GPT-2 supports tensor parallelism but not pipeline parallelism yet; "
                "use pipeline_parallel_size=1"
            )
        self.config = hf_config
        self.parallel = parallel
        self.hidden_size = hf_config.n_embd
        self.transformer = GPT2Model(hf_config, parallel, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None,
        attn_context: AttentionContext,
    ) -> torch.Tensor:
        output: torch.Tensor = self.transformer(input_ids, positions, kv_caches, attn_context)
        return output

    def logits_head(self) -> VocabParallelEmbedding:
        return self.transformer.wte  # tied LM head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden_states, self.logits_head())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def transposed(
            items: Iterable[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                if name.endswith(_CONV1D) and tensor.dim() == 2:
                    tensor = tensor.t()
                yield name, tensor

        def rename(name: str) -> tuple[str, Any] | None:
            if name.startswith("lm_head.") or name.endswith((".attn.bias", ".attn.masked_bias")):
                return None  # tied head; causal-mask buffers of old checkpoints
            if not name.startswith("transformer."):
                name = "transformer." + name  # checkpoints saved from GPT2Model
            return name, None

        load_params(self, transposed(weights), rename)
