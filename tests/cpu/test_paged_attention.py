"""The cpu backend's mixed step equals plain attention over each request's whole sequence.

One step holds two decodes, two fresh prompts of one length (one batched causal call),
a shorter fresh prompt, and a chunk with context already in the cache (its K/V gathered
from scattered blocks under an additive causal bias), with and without a sliding window
and with GQA (4 query heads over 2 KV heads). With head dim 16, on a CPU that prefers
enginecore's GEMM, the fresh prompts go to the fused prefill kernel; with head dim 8 they
stay with SDPA.
"""

from __future__ import annotations

import pytest
import torch

from enginecore.interfaces import AttentionSpec
from enginecore.layers import Attention
from enginecore.layers.torch_attention import prefill_runs, write_kv
from enginecore.testing.attention_steps import make_batch
from enginecore_cpu import cpu_kernels, panel_gemm
from enginecore_cpu.attention import CpuAttentionBackend

BLOCK = 4
HQ, HKV = 4, 2
# (tokens already in the cache, tokens this step); decodes first, as the runner orders them
REQUESTS = [(5, 1), (9, 1), (0, 6), (0, 6), (0, 3), (7, 5)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int | None):
    """Attention of queries at positions ctx.. over keys 0..; q [n, HQ, D], k/v [L, HKV, D]."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    q_pos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("D", [8, 16])
@pytest.mark.parametrize("kernel_max_len", [None, 5, 0])
def test_mixed_step_matches_plain_attention(window, D, kernel_max_len, monkeypatch):
    if kernel_max_len == 0:  # switched off with enginecore's GEMM
        monkeypatch.setenv(panel_gemm.ENV_SWITCH, "0")
    elif kernel_max_len is not None:  # prompts longer than this stay with SDPA
        limit = kernel_max_len * (D + cpu_kernels.PREFILL_QUERY_BLOCK) * 4
        monkeypatch.setattr(cpu_kernels, "PREFILL_ATTENTION_BYTES", limit)
    kernels = cpu_kernels.load()
    fused_calls = []
    if kernels is not None:
        original = type(kernels).prefill_attention
        spy = lambda self, *a: fused_calls.append(a[3].tolist()) or original(self, *a)  # noqa: E731
        monkeypatch.setattr(type(kernels), "prefill_attention", spy)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 40
    cache = torch.zeros(2, num_blocks, BLOCK, HKV, D)
    # Each request's blocks, handed out in a shuffled order so gathers cross blocks.
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, full_k, full_v = [], [], []
    for ctx, n in REQUESTS:
        blocks = [free.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        tables.append(blocks)
        full_k.append(torch.randn(ctx + n, HKV, D, generator=gen))
        full_v.append(torch.randn(ctx + n, HKV, D, generator=gen))

    def slots(r: int, positions: range) -> list[int]:
        return [tables[r][p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    for r, (ctx, _) in enumerate(REQUESTS):  # what earlier steps wrote
        if ctx:
            index = torch.tensor(slots(r, range(ctx)))
            write_kv(cache, full_k[r][:ctx], full_v[r][:ctx], index)

    new_slots = [s for r, (ctx, n) in enumerate(REQUESTS) for s in slots(r, range(ctx, ctx + n))]
    batch = make_batch([n for _, n in REQUESTS], [ctx for ctx, _ in REQUESTS], tables, BLOCK)
    assert batch.slot_mapping.tolist() == new_slots
    spec = AttentionSpec(
        1, HQ, HKV, D, torch.float32, torch.device("cpu"), BLOCK, 64, 8, 64, window is not None
    )
    backend = CpuAttentionBackend(spec)
    meta = backend.build_metadata(batch)
    runs = [(run.req_start, run.num_reqs) for run in meta.prefill.runs]
    assert runs == [(0, 2), (2, 1), (3, 1)]  # the equal fresh prompts share one call

    total = sum(n for _, n in REQUESTS)
    query = torch.randn(total, HQ, D, generator=gen)
    key = torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, REQUESTS, strict=True)])
    value = torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, REQUESTS, strict=True)])
    layer = Attention(HQ, D, D**-0.5, HKV, sliding_window=window)
    got = backend.forward(layer, query, key, value, cache, meta)
    if panel_gemm.preferred() and D == 16 and window is None:
        # the three fresh prompts in one call, or the one of 3 tokens
        assert fused_calls == ([[0, 6, 12]] if kernel_max_len is None else [[12]])
    else:
        assert fused_calls == []

    start = 0
    for r, (ctx, n) in enumerate(REQUESTS):
        want = reference(query[start : start + n], full_k[r], full_v[r], ctx, window)
        torch.testing.assert_close(got[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n
    # The step's K/V landed in the cache at the slot mapping.
    flat = cache.view(2, -1, HKV, D)
    torch.testing.assert_close(flat[0, torch.tensor(new_slots)], key)


def test_prefill_runs_batch_only_consecutive_fresh_prompts_of_one_length():
    runs = prefill_runs([8, 8, 8, 5, 8, 8, 4], [0, 0, 0, 0, 0, 3, 0])
    shape = [(r.token_start, r.req_start, r.num_reqs, r.query_len, r.context_len) for r in runs]
    assert shape == [
        (0, 0, 3, 8, 0),
        (24, 3, 1, 5, 0),
        (29, 4, 1, 8, 0),
        (37, 5, 1, 8, 3),
        (45, 6, 1, 4, 0),
    ]
