"""BERT-family encoders (``BertModel``, as sentence-transformers checkpoints ship it).

An encoder attends in both directions over the whole prompt, so it keeps no KV cache: the
pooling runner runs it once a request's prompt is complete, over padded batches, with
parameter names as the checkpoint spells them. One rank (no tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import SINGLE_RANK, ParallelContext
from enginecore.errors import UnsupportedModelError
from enginecore.layers.weights import load_params

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        x = x + self.token_type_embeddings.weight[0]
        output: torch.Tensor = self.LayerNorm(x)
        return output


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=mask
        )
        return out.transpose(1, 2).reshape(b, t, h)


class BertDenseNorm(nn.Module):
    """``dense`` then dropout-free residual ``LayerNorm`` (BERT's ``*Output`` blocks)."""

    def __init__(self, cfg: Any, in_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.LayerNorm(self.dense(x) + residual)
        return output


class BertAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertDenseNorm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.output(self.self(x, mask), x)
        return output


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        act = _ACTIVATIONS.get(cfg.hidden_act)
        if act is None:
            raise UnsupportedModelError(
                f"BERT activation {cfg.hidden_act!r} is not served (known: {sorted(_ACTIVATIONS)})"
            )
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertDenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        output: torch.Tensor = self.output(self.intermediate(x), x)
        return output


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """``forward(input_ids [batch, tokens], lengths [batch])`` -> hidden states
    ``[batch, tokens, hidden]``; rows past a prompt's length are padding."""

    is_encoder = True

    def __init__(
        self,
        hf_config: Any,
        parallel: ParallelContext = SINGLE_RANK,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if parallel.world_size > 1:
            raise UnsupportedModelError("BertModel runs on one rank (no tensor parallelism)")
        if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"BERT position_embedding_type {hf_config.position_embedding_type!r} "
                "is not served (only 'absolute')"
            )
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.embeddings = BertEmbeddings(hf_config)
        self.encoder = BertEncoder(hf_config)
        self.to(dtype)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        keep = torch.arange(t, device=input_ids.device)[None, :] < lengths[:, None]
        mask = keep[:, None, None, :]  # [batch, 1, 1, keys]: padding keys are masked
        x: torch.Tensor = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> tuple[str, Any] | None:
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                return None  # the pooler head and heads for other tasks are not used
            return name, None

        load_params(self, weights, rename)
