"""The Triton paged-attention kernels against torch SDPA over a dense copy of the cache.

    python benchmarks/triton_attention_check.py            # on a GPU (CUDA or ROCm)
    python benchmarks/triton_attention_check.py --tiny     # anywhere; on CPU, interpreted

Each scenario fills a paged KV cache whose blocks are handed out in shuffled order, then
runs ``paged_attention`` (K/V read in place through the block table) and the dense path
(K/V gathered out of the cache, decodes into one buffer padded to their longest context, then
SDPA with a mask) on the same batch. Both are compared with attention spelled out in fp32
one request at a time; the script prints the max abs error of each, the time per call (median over ``--iters``) and, for the
kernel, the K/V bytes it reads per second. It exits non-zero when the kernel's error exceeds
the tolerance of the dtype. Scenarios: decode batches of 64 and 256 sequences with contexts up
to ``--context``, one long decode (split-KV), a mixed step (decodes, chunked prefill on top of
context, a fresh prompt, verification rows) and the same with a sliding window and
soft-capping.

Without a GPU, ``--tiny`` sets ``TRITON_INTERPRET=1`` and runs small shapes on Triton's CPU
interpreter (correctness only; its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@dataclass
class Scenario:
    name: str
    requests: list[tuple[int, int]]  # (cached context, queries this step)
    sliding_window: int | None = None
    soft_cap: float | None = None
    num_kv_splits: int | None = None  # None: the kernels' own choice


def scenarios(args: argparse.Namespace, gen: torch.Generator) -> list[Scenario]:
    ctx = args.context

    def contexts(n: int) -> list[int]:
        return torch.randint(ctx // 2, ctx + 1, (n,), generator=gen).tolist()

    if args.tiny:
        mixed = [(c, 1) for c in contexts(3)] + [(9, 5), (0, 7), (13, 3)]
        return [
            Scenario("decode x4", [(c, 1) for c in contexts(4)]),
            Scenario("decode x1 long", [(ctx * 3, 1)]),
            # Long enough for several KV tiles per split.
            Scenario("decode x2, 3 splits", [(ctx * 15, 1), (ctx * 8, 1)], num_kv_splits=3),
            Scenario("mixed", mixed),
            Scenario("mixed, window+cap", mixed, sliding_window=8, soft_cap=5.0),
        ]
    mixed = (
        [(c, 1) for c in contexts(48)]
        + [(c, 4) for c in contexts(12)]  # speculative verification: 3 drafts + 1
        + [(ctx // 2, 512), (1024, 512), (0, 1024)]  # chunked prefill, prefix hit, fresh
    )
    return [
        Scenario("decode x64", [(c, 1) for c in contexts(64)]),
        Scenario("decode x256", [(c, 1) for c in contexts(256)]),
        Scenario("decode x1 long", [(4 * ctx, 1)]),
        Scenario("decode x64, 4 splits", [(c, 1) for c in contexts(64)], num_kv_splits=4),
        Scenario("mixed", mixed),
        Scenario("mixed, window+cap", mixed, sliding_window=1024, soft_cap=50.0),
    ]


def build_batch(s: Scenario, args: argparse.Namespace, dtype, device, gen) -> dict:
    """Shapes and block order drawn on the host from ``gen``; values drawn on the device."""
    block_size = args.block_size
    seq_lens = [c + q for c, q in s.requests]
    q_lens = [q for _, q in s.requests]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    pool = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    taken = 0
    for r, n in enumerate(blocks):
        block_table[r, :n] = pool[taken : taken + n]
        taken += n
    shape = (2, num_blocks, block_size, args.kv_heads, args.head_size)
    values = torch.Generator(device=device).manual_seed(len(s.requests))
    kv_cache = torch.randn(shape, generator=values, device=device, dtype=dtype)
    query_shape = (sum(q_lens), args.q_heads, args.head_size)
    query = torch.randn(query_shape, generator=values, device=device, dtype=dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "query": query,
        "kv_cache": kv_cache,
        "query_start_loc": qsl.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "block_table": block_table.to(device),
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "scale": args.head_size**-0.5,
        "sliding_window": s.sliding_window,
        "logits_soft_cap": s.soft_cap,
    }


def gather_kv(b: dict, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of requests ``rows`` copied out of the paged cache: [R, H_kv, length, D]."""
    kv_cache = b["kv_cache"]
    block_size = kv_cache.shape[2]
    key_pos = torch.arange(length, device=kv_cache.device)
    blocks = b["block_table"][rows].long()[:, key_pos // block_size]
    k = kv_cache[0][blocks, key_pos % block_size].transpose(1, 2)
    v = kv_cache[1][blocks, key_pos % block_size].transpose(1, 2)
    return k, v


def visible_keys(q_pos: torch.Tensor, seq_len: torch.Tensor, length: int, window: int | None):
    """[..., q, length] mask: causal, inside the sequence and (optionally) the window."""
    key_pos = torch.arange(length, device=q_pos.device)
    visible = (key_pos <= q_pos[..., None]) & (key_pos < seq_len[..., None, None])
    if window:
        visible &= key_pos > q_pos[..., None] - window
    return visible


def reference_attention(b: dict) -> torch.Tensor:
    """fp32 attention spelled out one request at a time (soft-cap included)."""
    query = b["query"].float()
    qsl, seq_lens = b["query_start_loc"].tolist(), b["seq_lens"].tolist()
    group = query.shape[1] // b["kv_cache"].shape[3]
    cap = b["logits_soft_cap"]
    out = torch.empty_like(query)
    for r, seq_len in enumerate(seq_lens):
        begin, end = qsl[r], qsl[r + 1]
        k, v = gather_kv(b, torch.tensor([r], device=query.device), seq_len)
        k = k[0].float().repeat_interleave(group, 0)  # [H_q, S, D]
        v = v[0].float().repeat_interleave(group, 0)
        q = query[begin:end].transpose(0, 1)  # [H_q, q, D]
        scores = q @ k.transpose(1, 2) * b["scale"]
        if cap:
            scores = cap * torch.tanh(scores / cap)
        q_pos = torch.arange(seq_len - (end - begin), seq_len, device=query.device)
        seq = torch.tensor(seq_len, device=query.device)
        scores = scores.masked_fill(
            ~visible_keys(q_pos, seq, seq_len, b["sliding_window"]), float("-inf")
        )
        out[begin:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def dense_attention(b: dict) -> torch.Tensor:
    """The dense-copy path: decodes as one SDPA call over K/V gathered into a buffer padded to
    their longest context, every other request as its own SDPA call over its gathered K/V."""
    query = b["query"]
    qsl = b["query_start_loc"].tolist()
    q_lens = [qsl[r + 1] - qsl[r] for r in range(len(qsl) - 1)]
    seq_lens = b["seq_lens"]
    gqa = query.shape[1] != b["kv_cache"].shape[3]
    out = torch.empty_like(query)
    decodes = [r for r, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor(decodes, device=query.device)
        longest = int(seq_lens[rows].max())
        k, v = gather_kv(b, rows, longest)
        q_pos = (seq_lens[rows] - 1)[:, None]
        mask = visible_keys(q_pos, seq_lens[rows], longest, b["sliding_window"])
        tokens = b["query_start_loc"][rows].long()
        out[tokens] = torch.nn.functional.scaled_dot_product_attention(
            query[tokens][:, :, None],
            k,
            v,
            attn_mask=mask[:, None],
            scale=b["scale"],
            enable_gqa=gqa,
        )[:, :, 0]
    for r, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        seq_len = int(seq_lens[r])
        k, v = gather_kv(b, torch.tensor([r], device=query.device), seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = visible_keys(q_pos, seq_lens[r], seq_len, b["sliding_window"])
        out[qsl[r] : qsl[r + 1]] = torch.nn.functional.scaled_dot_product_attention(
            query[qsl[r] : qsl[r + 1]].transpose(0, 1)[None],
            k,
            v,
            attn_mask=mask[None, None],
            scale=b["scale"],
            enable_gqa=gqa,
        )[0].transpose(0, 1)
    return out


def time_call(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds per call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kv_bytes_read(b: dict) -> int:
    """K and V bytes each KV head's programs must read at least once: every cached key."""
    c = b["kv_cache"]
    keys = int(b["seq_lens"].sum())
    if b["sliding_window"]:
        keys = int(b["seq_lens"].clamp(max=b["sliding_window"] + b["max_query_len"]).sum())
    return 2 * keys * c.shape[3] * c.shape[4] * c.element_size()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None)
    parser.add_argument("--head-size", type=int, default=None)
    parser.add_argument("--q-heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="longest decode context")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        if not args.tiny:
            parser.error("no GPU here: pass --tiny to run small shapes on the interpreter")
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import
    defaults = (
        {"dtype": "float32", "head_size": 32, "q_heads": 4, "kv_heads": 2, "block_size": 4}
        | {"context": 40, "iters": 1}
        if args.tiny
        else {"dtype": "bfloat16", "head_size": 128, "q_heads": 32, "kv_heads": 8}
        | {"block_size": 16, "context": 4096, "iters": 20}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from enginecore_attention import triton_kernels

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    where = torch.cuda.get_device_name(device) if on_gpu else "CPU, Triton interpreter"
    print(
        f"# {where}; {args.dtype}, head {args.head_size}, {args.q_heads} q / "
        f"{args.kv_heads} kv heads, block {args.block_size}; torch {torch.__version__}"
    )
    header = (
        f"{'scenario':<20} {'reqs':>5} {'tokens':>6} {'max ctx':>7} {'splits':>6} "
        f"{'err triton':>10} {'err dense':>10} {'triton ms':>9} {'dense ms':>9} {'GB/s':>7}"
    )
    print(header)
    failed = []
    for s in scenarios(args, gen):
        b = build_batch(s, args, dtype, device, gen)
        kwargs = {k: v for k, v in b.items() if k not in ("query", "kv_cache")}
        kwargs["num_kv_splits"] = s.num_kv_splits
        out = torch.empty_like(b["query"])

        def run_kernel(out=out, b=b, kwargs=kwargs):
            triton_kernels.paged_attention(b["query"], b["kv_cache"], out, **kwargs)

        run_kernel()
        expected = reference_attention(b)
        err_kernel = (out.float() - expected).abs().max().item()
        ms_kernel = time_call(run_kernel, args.iters, device) * 1e3
        if s.soft_cap is None:  # SDPA has no soft-capping
            dense = dense_attention(b)
            err_dense = f"{(dense.float() - expected).abs().max().item():.2e}"
            ms_dense = f"{time_call(lambda b=b: dense_attention(b), args.iters, device) * 1e3:.3f}"
            del dense
        else:
            err_dense = ms_dense = "-"
        # Interpreted times say nothing about a GPU's bandwidth.
        bandwidth = f"{kv_bytes_read(b) / ms_kernel / 1e6:.0f}" if on_gpu else "-"
        splits = s.num_kv_splits or triton_kernels.default_kv_splits(
            b["query"],
            b["kv_cache"],
            num_reqs=len(s.requests),
            max_query_len=b["max_query_len"],
            max_seq_len=b["max_seq_len"],
        )
        print(
            f"{s.name:<20} {len(s.requests):>5} {b['query'].shape[0]:>6} "
            f"{b['max_seq_len']:>7} {splits:>6} {err_kernel:>10.2e} {err_dense:>10} "
            f"{ms_kernel:>9.3f} {ms_dense:>9} {bandwidth:>7}"
        )
        if not err_kernel <= TOLERANCE[dtype]:
            failed.append(s.name)
        del b, kwargs, out, expected
    if failed:
        print(f"FAILED: error above {TOLERANCE[dtype]:g} in {', '.join(failed)}")
        return 1
    print(f"ok: every error within {TOLERANCE[dtype]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
