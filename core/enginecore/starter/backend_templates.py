"""``enginecore plugin new`` files for the two compute kinds: an attention backend and a
linear method. Each is built only on the public API (``enginecore.interfaces``,
``enginecore.layers``) and passes its conformance kit as generated."""

from __future__ import annotations

ATTENTION_BACKEND = '''"""$cls: attention over the paged KV cache, one request at a time.

A correct, slow starting point on the public API only: ``build_metadata`` turns the
step's batch into what ``forward`` needs, ``forward`` writes the step's K/V into the
cache and attends. Replace ``_attend`` (and the per-request loop) with your kernel; the
conformance kit checks every case the engine sends (mixed prefills and decodes, prefix
hits, sliding windows, soft-capping, the profiling pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from enginecore.interfaces import AttentionBackend, AttentionCapabilities


@dataclass
class ${cls}Metadata:
    slots: torch.Tensor  # [T] the cache slot of each new token
    requests: list[tuple[int, int, int, list[int]]]  # (first row, rows, seq_len, blocks)


class $cls(AttentionBackend):
    name = "$component"
    capabilities = AttentionCapabilities(devices=("cpu", "cuda"))
    priority = -10  # never chosen by "auto": selected by name until it is faster

    def build_metadata(self, batch: Any) -> ${cls}Metadata:
        starts = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        requests = [
            (starts[r], starts[r + 1] - starts[r], seq_lens[r], batch.block_table[r].tolist())
            for r in range(len(seq_lens))
        ]
        slots = torch.from_numpy(batch.slot_mapping).to(self.spec.device)
        return ${cls}Metadata(slots, requests)

    def forward(self, layer, query, key, value, kv_cache, metadata):
        if kv_cache is None:
            # The memory-profiling pass: metadata is build_profile_metadata's result,
            # by default the plain list of the fresh prompts' query lengths.
            return self._attend_fresh(layer, query, key, value, metadata)
        _, blocks, size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, blocks * size, heads, dim)
        flat[0][metadata.slots] = key.to(flat.dtype)
        flat[1][metadata.slots] = value.to(flat.dtype)
        out = torch.empty_like(query)
        for first, rows, seq_len, table in metadata.requests:
            positions = torch.arange(seq_len, device=query.device)
            block_starts = torch.tensor(table, device=query.device)[positions // size] * size
            slots = block_starts + positions % size
            out[first : first + rows] = self._attend(
                layer, query[first : first + rows], flat[0][slots], flat[1][slots], seq_len
            )
        return out

    def _attend_fresh(self, layer, query, key, value, query_lens):
        out = torch.empty_like(query)
        start = 0
        for n in query_lens:
            rows = slice(start, start + n)
            out[rows] = self._attend(layer, query[rows], key[rows], value[rows], n)
            start += n
        return out

    @staticmethod
    def _attend(layer, q, k, v, seq_len):
        """q [n, Hq, D] at the last n positions of a sequence of k/v [seq_len, Hkv, D]."""
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1).float()
        v = v.repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * layer.scale
        if layer.logits_soft_cap is not None:
            cap = layer.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        seen = k_pos <= q_pos
        if layer.sliding_window is not None:
            seen &= k_pos > q_pos - layer.sliding_window
        scores = scores.masked_fill(~seen, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
'''

ATTENTION_BACKEND_TEST = '''"""Tests of $cls: enginecore's attention-backend conformance kit."""

from __future__ import annotations

import enginecore
from enginecore.testing import AttentionBackendContract

from $package import $cls


class Test${cls}Contract(AttentionBackendContract):
    backend = "$component"  # the registered name, as a config selects it
    dtypes = ("float32", "bfloat16")
'''

LINEAR_METHOD = '''"""$cls: how each projection's weights are stored and multiplied.

Starts as the reference (weights as in the checkpoint, ``F.linear``) on the public API
only; quantize or repack in ``process_weights_after_loading`` and compute in ``apply``.
The conformance kit compares ``apply`` with ``x @ W^T + b`` within ``tolerance``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from enginecore.interfaces import LinearMethod
from enginecore.layers import VocabParallelEmbedding
from enginecore.layers.weights import make_param, set_weight_attrs


class $cls(LinearMethod):
    name = "$component"
    priority = -10  # never chosen by "auto": selected by name
    devices = ("cpu", "cuda")
    dtypes = ("float32", "bfloat16", "float16")

    def create_weights(self, layer: Any, input_size: int, output_size: int, dtype: Any) -> None:
        weight = make_param((output_size, input_size), dtype)
        # The layer's loader copies this rank's shard of the checkpoint tensor.
        set_weight_attrs(weight, {"weight_loader": layer.weight_loader})
        layer.weight = weight

    def process_weights_after_loading(self, layer: Any) -> None:
        if isinstance(layer, VocabParallelEmbedding):
            return  # the LM head: its table also serves the embedding lookup
        # Repack or quantize layer.weight here (once per layer, after loading).

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
'''

LINEAR_METHOD_TEST = '''"""Tests of $cls: enginecore's linear-method conformance kit."""

from __future__ import annotations

import enginecore
from enginecore.testing import LinearMethodContract

from $package import $cls


class Test${cls}Contract(LinearMethodContract):
    method = "$component"  # the registered name, as a config selects it
    dtypes = ("float32",)
    # A quantizing method sets its error bound per activation dtype:
    # tolerance = {"float32": 1e-2, "bfloat16": 3e-2, "float16": 3e-2}
'''
