"""The vocabulary-parallel embedding and LM head.

The vocabulary is split across TP ranks (padded to a multiple of ``tp_size``): each rank
looks up the ids it owns, zeros the rest, and an all-reduce assembles the embedding; the
head computes this rank's slice of the logits, then all-gathers them. The logits product
goes through the layer's linear method, like every projection, so a backend may pack or
quantize the head; a head tied to the embedding is the embedding itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from enginecore.distributed import ParallelContext
from enginecore.layers.linear import current_linear_method
from enginecore.layers.parallel import tp_all_gather_last_dim, tp_all_reduce
from enginecore.layers.quantized import QuantizedTensor
from enginecore.layers.weights import default_weight_loader, make_param, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """Token embedding split along the vocabulary."""

    def __init__(
        self, num_embeddings: int, dim: int, *, parallel: ParallelContext, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, num_embeddings)
        self.weight = make_param((self.per_rank, dim), dtype)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        # Computes the logits where this table serves as the LM head.
        self.linear_method = current_linear_method()

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | QuantizedTensor, shard: Any = None
    ) -> None:
        if isinstance(loaded, QuantizedTensor):
            table = self._table_from_blocks(param, loaded)
            if table is None:
                return
            loaded = table
        if self.parallel.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: vocabulary {self.num_embeddings}, checkpoint "
                f"{tuple(loaded.shape)}"
            )
        n = self.vocab_end - self.vocab_start
        param.data.zero_()
        default_weight_loader(param.data[:n], loaded[self.vocab_start : self.vocab_end])

    def _table_from_blocks(
        self, param: torch.Tensor, blocks: QuantizedTensor
    ) -> torch.Tensor | None:
        """A table the loader kept in blocks (a GGUF file's): the linear method's table for
        it, which becomes the weight (None returned: nothing left to copy), else the
        blocks de-quantized, to copy as a float checkpoint's."""
        if self.parallel.tp_size == 1:
            table = self.linear_method.embedding_table(self, blocks)
            if table is not None:
                if table.shape != param.shape or table.dtype != param.dtype:
                    raise ValueError(
                        f"{type(self.linear_method).__name__}.embedding_table gave "
                        f"{tuple(table.shape)} {table.dtype} for a {tuple(param.shape)} "
                        f"{param.dtype} weight"
                    )
                param.data = table
                return None
        from enginecore.block_formats.parts import dequantized_part, unpacked

        return dequantized_part(unpacked(blocks))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection (vocab-parallel); may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self)


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """Full-vocabulary logits from a vocab-parallel weight: local slice, then all-gather."""
    logits: torch.Tensor = head.linear_method.apply(head, hidden)
    if head.parallel.tp_size == 1:
        return logits
    return tp_all_gather_last_dim(logits, head.parallel)[..., : head.num_embeddings]
