"""NaiveAttentionBackend: each request's K/V read through its block table, one request
at a time. Uses only enginecore's public API."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginecore.interfaces import AttentionBackend, AttentionCapabilities


@dataclass
class NaiveMetadata:
    slots: torch.Tensor  # [T] cache slot of each new token
    requests: list[tuple[int, int, int, list[int]]]  # (first row, rows, seq_len, blocks)


class NaiveAttentionBackend(AttentionBackend):
    name = "naive"
    capabilities = AttentionCapabilities(devices=("cpu", "cuda"))
    priority = -10  # never chosen by "auto": only by name

    def build_metadata(self, batch):
        qsl = batch.query_start_loc.tolist()
        seq = batch.seq_lens.tolist()
        requests = [
            (qsl[r], qsl[r + 1] - qsl[r], seq[r], batch.block_table[r].tolist())
            for r in range(len(seq))
        ]
        slots = torch.from_numpy(batch.slot_mapping).to(self.spec.device)
        return NaiveMetadata(slots, requests)

    def forward(self, layer, query, key, value, kv_cache, metadata):
        if kv_cache is None:  # the profiling pass: fresh prompts of these lengths
            return self._attend_fresh(layer, query, key, value, metadata)
        _, blocks, size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, blocks * size, heads, dim)
        flat[0][metadata.slots] = key.to(flat.dtype)
        flat[1][metadata.slots] = value.to(flat.dtype)
        out = torch.empty_like(query)
        for first, rows, seq_len, table in metadata.requests:
            positions = torch.arange(seq_len, device=query.device)
            ids = torch.tensor(table, device=query.device)[positions // size] * size
            slots = ids + positions % size
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
