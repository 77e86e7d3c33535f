"""The attention layer models call, and what a step hands the attention backend.

A model builds one :class:`Attention` per layer and calls it with this step's
projected query, key and value. The layer does no attention itself: it hands the tensors
to the step's :class:`AttentionContext`, which carries the selected backend
(:class:`enginecore.interfaces.AttentionBackend`) and the per-step metadata that backend
built from the runner's :class:`AttentionBatch`. Writing K/V into the paged cache and
attending are both the backend's, so a model never depends on a device.

Sliding windows follow transformers' convention: a query at absolute position ``q`` sees
key ``k`` iff ``q - window < k <= q`` (the last ``window`` positions including its own).
Where the scheduler manages KV cache groups, sliding layers keep only their window: the
blocks before it are released, and their block-table entries (stale ids or block 0)
are masked out, never read as context.
Soft-capping (Gemma 2) applies ``cap * tanh(score / cap)`` to the scaled scores before
the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from enginecore.errors import ConfigError
from enginecore.layers.contract_checks import check_attention_output


@dataclass
class AttentionBatch:
    """One step's requests as the runner lays them out, host-side (numpy).

    Requests are in batch order; the first ``num_decodes`` have exactly one query token.
    Request ``r``'s query tokens are rows ``query_start_loc[r]:query_start_loc[r + 1]`` of
    the step's flattened tokens, at positions ``context_lens[r] ..
    context_lens[r] + query_lens[r] - 1``.
    """

    req_ids: list[str]
    query_lens: np.ndarray  # [R] int64
    context_lens: np.ndarray  # [R] int64: tokens already in the cache before this step
    block_table: np.ndarray  # [R, max_blocks] int64, rows padded with 0
    slot_mapping: np.ndarray  # [T] int64: cache slot of each new token
    num_decodes: int
    # Which KV cache group's block table this is (several with sliding-window layers,
    # one batch per group, each with that group's block_table and slot_mapping).
    kv_cache_group: int = 0

    @property
    def seq_lens(self) -> np.ndarray:
        seq_lens: np.ndarray = self.context_lens + self.query_lens
        return seq_lens

    @property
    def query_start_loc(self) -> np.ndarray:
        out = np.zeros(len(self.query_lens) + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=out[1:])
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


@dataclass
class AttentionContext:
    """What every attention layer of one forward pass shares: the backend and its
    metadata for this step (``None`` metadata with no KV cache: the profiling pass)."""

    backend: Any  # enginecore.interfaces.AttentionBackend
    metadata: Any
    # A KVConnectorBridge while a KV connector is active: each layer waits for its loads
    # before attending and offers its K/V for saving after the write.
    kv_connector: Any = None
    # The step's batch as the runner laid it out (None in the profiling pass), for a
    # model that needs per-request facts beyond its attention layers.
    batch: AttentionBatch | None = None
    # Several KV cache groups: the backend's metadata for each group's batch (layer
    # ``kv_cache_group`` reads its own); None with one group (``metadata`` serves all).
    group_metadata: list[Any] | None = None


class Attention(nn.Module):
    """Multi-head attention over the paged KV cache, for this rank's heads.

    ``num_heads`` query heads share ``num_kv_heads`` KV heads (GQA when fewer);
    ``sliding_window`` limits what each query sees; ``logits_soft_cap`` caps the scores.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly"
            )
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Set by the model runner: the KV cache group whose block table this layer reads.
        self.kv_cache_group = 0

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """``query`` [T, num_heads, head_dim], ``key``/``value`` [T, num_kv_heads,
        head_dim] -> [T, num_heads, head_dim]."""
        connector = ctx.kv_connector
        metadata = ctx.metadata
        if ctx.group_metadata is not None:
            metadata = ctx.group_metadata[self.kv_cache_group]
        if connector is not None and kv_cache is not None:
            connector.wait_for_layer_load(kv_cache)
            out: torch.Tensor = ctx.backend.forward(self, query, key, value, kv_cache, metadata)
            check_attention_output(ctx.backend, self, query, out)
            connector.save_layer(kv_cache)
            return out
        output: torch.Tensor = ctx.backend.forward(self, query, key, value, kv_cache, metadata)
        check_attention_output(ctx.backend, self, query, output)
        return output


def layer_sliding_windows(hf_config: Any) -> list[int | None]:
    """The attention window of each layer (None: full attention).

    Mistral applies ``config.sliding_window`` to every layer; Qwen2 (and any config with
    ``layer_types``) only to the layers marked ``"sliding_attention"`` (for Qwen2,
    ``use_sliding_window`` and layers ``>= max_window_layers``).
    """
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", None) is False:
        window = None  # the Qwen configs carry a sliding_window they ignore unless enabled
    if window is None or window == 0:  # Qwen2-MoE writes 0 for "no window"
        return [None] * num_layers
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"config.json: layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ConfigError(
            f"config.json: layer_types {unknown} are not supported "
            "(only 'sliding_attention' and 'full_attention')"
        )
    return [window if t == "sliding_attention" else None for t in layer_types]
