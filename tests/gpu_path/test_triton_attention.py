"""The Triton paged-attention kernels, run on the CPU by Triton's interpreter, against a
float64 reference written here in plain torch.

The reference gathers each request's keys and values through its block table, applies the
causal mask (and the sliding window), soft-caps the scaled scores and takes a softmax. Batches
mix what one engine step holds: decodes, fresh prefills, prefills on top of cached context,
verification-like rows (several queries on top of context) and an empty request; the cache is
filled with random values everywhere, so a key read from the wrong block shows up.

Two things the interpreter does differently from a GPU: it rounds fp32 to bf16 by truncation,
and the kernel widens bf16 tiles to fp32 before tl.dot there (see triton_kernels). Code the
interpreter accepts but a GPU compiler would reject is caught by a slow test that compiles the
kernels for NVIDIA sm_90 and AMD gfx942 with the compilers shipped in the triton wheel.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

# The interpreter is chosen when a @triton.jit function is defined, so this must precede the
# import of the kernels' module.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from enginecore_attention import triton_kernels

if not triton_kernels.is_interpreted():  # imported earlier in this process without the flag
    triton_kernels = importlib.reload(triton_kernels)

# (cached context, queries this step) per request: two decodes, a fresh prefill, a prefill with
# context (chunked prefill or prefix-cache hit), a verification-like row and an empty request.
MIXED = [(7, 1), (13, 1), (0, 6), (9, 5), (11, 3), (4, 0)]


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 32,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    padding_tokens: int = 0,
    seed: int = 0,
) -> dict:
    """Random query and cache, with each request's blocks drawn from a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + q for ctx, q in requests]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks that no request owns
    max_blocks = max(blocks_per_req)
    pool = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    taken = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = pool[taken : taken + n]
        taken += n
    q_lens = [q for _, q in requests]
    num_tokens = sum(q_lens) + padding_tokens
    query = torch.randn(num_tokens, num_kv_heads * group, head_size, generator=gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "query": query.to(dtype),
        "kv_cache": kv_cache.to(dtype),
        "query_start_loc": query_start_loc,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": block_table,
        "max_query_len": max(q_lens),
        "max_seq_len": max(seq_lens),
        "scale": head_size**-0.5,
    }


def reference(batch: dict, sliding_window: int | None = None, soft_cap: float | None = None):
    """float64 attention per request over keys gathered through its block table."""
    query, kv_cache = batch["query"].double(), batch["kv_cache"].double()
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    qsl = batch["query_start_loc"].tolist()
    out = torch.zeros_like(query)
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        begin, end = qsl[r], qsl[r + 1]
        if begin == end:
            continue
        key_pos = torch.arange(seq_len)
        blocks = batch["block_table"][r, key_pos // block_size].long()
        k = kv_cache[0, blocks, key_pos % block_size].repeat_interleave(group, dim=1)
        v = kv_cache[1, blocks, key_pos % block_size].repeat_interleave(group, dim=1)
        query_pos = torch.arange(seq_len - (end - begin), seq_len)
        scores = torch.einsum("qhd,khd->hqk", query[begin:end], k) * batch["scale"]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        hidden = key_pos[None, :] > query_pos[:, None]
        if sliding_window is not None:
            hidden |= key_pos[None, :] <= query_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def metadata_of(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in ("query", "kv_cache")}


def run(batch: dict, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch["query"], float("nan"))
    triton_kernels.paged_attention(
        batch["query"], batch["kv_cache"], out, **metadata_of(batch), **kwargs
    )
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    num_valid = expected.shape[0]
    err = (actual[:num_valid].double() - expected).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} exceeds {atol:g}"


@pytest.mark.parametrize(
    ("head_size", "group", "block_size"),
    [(16, 1, 4), (32, 2, 16), (64, 4, 4), (24, 2, 4), (80, 1, 16), (32, 3, 4)],
)
def test_mixed_batch_matches_reference(head_size: int, group: int, block_size: int):
    batch = make_batch(MIXED, head_size=head_size, group=group, block_size=block_size)
    assert_close(run(batch), reference(batch), atol=1e-5)


@pytest.mark.parametrize(("window", "soft_cap"), [(4, None), (None, 2.0), (3, 1.5)])
def test_sliding_window_and_soft_cap(window: int | None, soft_cap: float | None):
    batch = make_batch(MIXED, group=2, block_size=4, seed=1)
    batch["scale"] = 1.0  # large scores, so the cap changes the result
    out = run(batch, sliding_window=window, logits_soft_cap=soft_cap)
    expected = reference(batch, sliding_window=window, soft_cap=soft_cap)
    assert_close(out, expected, atol=1e-5)
    # The option is not a no-op on this batch.
    assert (expected - reference(batch)).abs().max() > 1e-2


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_caches(dtype: torch.dtype, atol: float):
    batch = make_batch(MIXED, group=2, head_size=32, dtype=dtype, seed=2)
    out = run(batch, sliding_window=6)
    assert out.dtype == dtype
    assert_close(out, reference(batch, sliding_window=6), atol=atol)


@pytest.mark.parametrize(("num_kv_splits", "window"), [(1, None), (3, None), (4, 70)])
def test_long_context_across_many_shuffled_blocks(num_kv_splits: int, window: int | None):
    # 300 cached tokens in 4-token blocks: 75+ blocks scattered over the pool, several KV tiles
    # (of 64 keys at fp32 x 64), and with splits each split merges its own share of them.
    requests = [(300, 1), (37, 1), (250, 4), (0, 5)]
    batch = make_batch(requests, num_kv_heads=1, group=4, head_size=64, block_size=4, seed=3)
    assert len(set(batch["block_table"][0].tolist())) == 76
    out = run(batch, num_kv_splits=num_kv_splits, sliding_window=window)
    assert_close(out, reference(batch, sliding_window=window), atol=1e-5)


@pytest.mark.parametrize(("group", "window"), [(1, None), (2, 24)])
def test_long_prefills_span_several_query_tiles(group: int, window: int | None):
    # 64-row query tiles: the 70- and 45-token chunks take several tiles each (with context
    # behind one of them), between decodes whose tiles sit next to theirs.
    requests = [(20, 1), (50, 70), (3, 1), (0, 45), (9, 1)]
    batch = make_batch(requests, num_kv_heads=1, group=group, head_size=64, seed=7)
    out = run(batch, sliding_window=window)
    assert_close(out, reference(batch, sliding_window=window), atol=1e-5)


def test_length_hints_steer_tiling_only():
    # A CUDA graph captured on one batch is replayed on others with the same token count, so
    # the launch-time max_query_len / max_seq_len may understate the batch it runs on.
    batch = make_batch(MIXED, group=2, seed=8)
    hints = {**metadata_of(batch), "max_query_len": 1, "max_seq_len": 1}
    out = torch.full_like(batch["query"], float("nan"))
    triton_kernels.paged_attention(
        batch["query"], batch["kv_cache"], out, **hints, sliding_window=4, num_kv_splits=2
    )
    assert_close(out, reference(batch, sliding_window=4), atol=1e-5)


def test_int64_metadata():
    batch = make_batch(MIXED, group=4, seed=9)
    for name in ("query_start_loc", "seq_lens", "block_table"):
        batch[name] = batch[name].long()
    assert_close(run(batch), reference(batch), atol=1e-5)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_padding_rows_are_left_alone(num_kv_splits: int):
    batch = make_batch([(5, 1), (0, 3)], padding_tokens=3, seed=4)
    out = run(batch, num_kv_splits=num_kv_splits)
    assert_close(out, reference(batch)[:4], atol=1e-5)
    assert torch.isnan(out[4:]).all()


def test_write_kv_scatters_and_skips_padding_slots():
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, head_size = 6, 4, 3, 24
    kv_cache = torch.randn(2, num_blocks, block_size, heads, head_size, generator=gen)
    before = kv_cache.clone()
    slots = torch.tensor([9, -1, 0, 23, -1, 14], dtype=torch.int64)
    key = torch.randn(len(slots), heads, head_size, generator=gen)
    value = torch.randn(len(slots), heads, head_size, generator=gen)
    triton_kernels.write_kv(key, value, kv_cache, slots)

    expected = before.clone()
    keep = slots >= 0
    flat = expected.view(2, num_blocks * block_size, heads, head_size)
    flat[0, slots[keep]] = key[keep]
    flat[1, slots[keep]] = value[keep]
    assert torch.equal(kv_cache, expected)
    assert not torch.equal(kv_cache, before)


def test_write_kv_casts_to_the_cache_dtype():
    kv_cache = torch.zeros(2, 2, 4, 1, 16, dtype=torch.bfloat16)
    key = torch.randn(2, 1, 16)
    value = torch.randn(2, 1, 16)
    triton_kernels.write_kv(key, value, kv_cache, torch.tensor([5, 2]))
    # Within one bf16 step: the interpreter truncates where GPUs round to nearest.
    one_ulp = {"atol": 0.0, "rtol": 2**-7}
    torch.testing.assert_close(kv_cache[0, 1, 1], key[0].to(torch.bfloat16), **one_ulp)
    torch.testing.assert_close(kv_cache[1, 0, 2], value[1].to(torch.bfloat16), **one_ulp)
    assert kv_cache[:, 0, :2].eq(0).all() and kv_cache[:, 1, 2:].eq(0).all()


def test_write_then_attend_over_steps_equals_causal_attention():
    # One request, prefilled in two chunks and then decoded twice, through write_kv and
    # paged_attention, against causal attention over the whole sequence at once.
    gen = torch.Generator().manual_seed(6)
    heads_kv, group, head_size, block_size, total = 2, 2, 16, 4, 13
    q = torch.randn(total, heads_kv * group, head_size, generator=gen)
    k = torch.randn(total, heads_kv, head_size, generator=gen)
    v = torch.randn(total, heads_kv, head_size, generator=gen)
    blocks = torch.tensor([[5, 0, 3, 7]], dtype=torch.int32)
    kv_cache = torch.zeros(2, 8, block_size, heads_kv, head_size)
    outputs, done = [], 0
    for step in (5, 6, 1, 1):
        positions = torch.arange(done, done + step)
        slots = blocks[0, positions // block_size].long() * block_size + positions % block_size
        triton_kernels.write_kv(k[positions], v[positions], kv_cache, slots)
        out = torch.empty(step, heads_kv * group, head_size)
        triton_kernels.paged_attention(
            q[positions],
            kv_cache,
            out,
            query_start_loc=torch.tensor([0, step], dtype=torch.int32),
            seq_lens=torch.tensor([done + step], dtype=torch.int32),
            block_table=blocks,
            max_query_len=step,
            max_seq_len=done + step,
            scale=head_size**-0.5,
        )
        outputs.append(out)
        done += step
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1),
        k.double().repeat_interleave(group, 1).transpose(0, 1),
        v.double().repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert_close(torch.cat(outputs), expected, atol=1e-5)


def test_bad_arguments_raise_clear_errors():
    batch = make_batch([(3, 1)], num_kv_heads=2, group=2)
    out = torch.empty_like(batch["query"])
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        triton_kernels.paged_attention(
            batch["query"][:, :3], batch["kv_cache"], out[:, :3], **metadata_of(batch)
        )
    big = torch.zeros(1, 2, 512)
    with pytest.raises(ValueError, match="head_size 512 is above the 256"):
        triton_kernels.paged_attention(
            big, torch.zeros(2, 2, 4, 2, 512), torch.empty_like(big), **metadata_of(batch)
        )
    with pytest.raises(ValueError, match="query dtype"):
        triton_kernels.paged_attention(
            batch["query"].half(), batch["kv_cache"], out.half(), **metadata_of(batch)
        )
    bad_table = {**metadata_of(batch), "block_table": batch["block_table"].float()}
    with pytest.raises(ValueError, match="block_table must be int32 or int64"):
        triton_kernels.paged_attention(batch["query"], batch["kv_cache"], out, **bad_table)
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, num_blocks"):
        triton_kernels.paged_attention(
            batch["query"], batch["kv_cache"][0], out, **metadata_of(batch)
        )
    with pytest.raises(ValueError, match=r"kv_cache dtype torch\.float64 is not supported"):
        triton_kernels.write_kv(
            torch.zeros(1, 2, 32),
            torch.zeros(1, 2, 32),
            batch["kv_cache"].double(),
            torch.tensor([0]),
        )
    with pytest.raises(ValueError, match="slot_mapping must be int32/int64 of shape"):
        triton_kernels.write_kv(
            torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), batch["kv_cache"], torch.tensor([0])
        )


COMPILE_FOR_GPUS = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from enginecore_attention import triton_kernels as tk

    def compile_for(kernel, target, constexprs, pointers):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers.get(name, "*i32")
            elif name in ("scale", "soft_cap"):
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
        triton.compile(ASTSource(kernel, signature, constexprs), target=target)

    partials = {"partial_acc_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32"}
    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        # Triton turns integer arguments equal to 1 into constants at launch; the second
        # variant compiles the kernel as a one-request batch with unit strides would see it.
        ones = dict(num_reqs=1, stride_query_dim=1, stride_out_dim=1, stride_cache_dim=1,
                    stride_table_block=1)
        for dtype, precision, splits, unit in (("bf16", "tf32", 4, {}), ("fp32", "ieee", 1, ones)):
            compile_for(
                tk._paged_attention_kernel,
                target,
                dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, HEAD_PAD=128,
                     NUM_SPLITS=splits, USE_WINDOW=True, USE_SOFT_CAP=True,
                     DOT_PRECISION=precision, DOT_IN_FP32=False, **unit),
                {"query_ptr": "*" + dtype, "cache_ptr": "*" + dtype, "out_ptr": "*" + dtype,
                 **partials},
            )
        compile_for(tk._merge_splits_kernel, target,
                    dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_PAD=128),
                    {"out_ptr": "*bf16", **partials})
        compile_for(tk._write_kv_kernel, target, dict(HEADS_PAD=8, HEAD_PAD=128),
                    {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16",
                     "slot_mapping_ptr": "*i64"})
        print("compiled for", target.backend)
    """
)


@pytest.mark.slow
def test_kernels_compile_for_nvidia_and_amd_gpus():
    # The interpreter accepts code the GPU compiler rejects, so compile the kernels for real
    # (NVIDIA sm_90 and AMD gfx942) with the compilers bundled in the triton wheel; no GPU needed.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_GPUS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split("\n")[:2] == ["compiled for cuda", "compiled for hip"]


# --- the backend: the contract, and greedy parity through the engine ----------------------

from enginecore.testing import AttentionBackendContract  # noqa: E402


class TestTritonBackendContract(AttentionBackendContract):
    """The same matrix the torch and cpu backends pass (test_attention_backends.py)."""

    backend = "triton"
    dtypes = ("float32", "bfloat16")


def test_llm_on_the_triton_backend_gives_transformers_greedy_tokens(tiny_llama):
    """``LLM(attention_backend="triton")`` under the interpreter: one mixed batch with
    chunked prefill, a prefix-cache hit and preemption (11 blocks of 4 tokens for three
    requests of 30 tokens) gives transformers' greedy tokens."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.hf_reference import greedy_reference

    shared = list(range(40, 56))
    prompts = [[*shared, 5, 6, 7, 8], list(range(100, 124)), [*shared, 9, 10]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(
        tiny_llama,
        attention_backend="triton",
        dtype="float32",
        max_num_batched_tokens=16,
        block_size=4,
        num_blocks_override=12,
    ) as llm:
        [backend] = llm.collective_rpc(lambda w: w.model_runner.attn_backend.name)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert backend == "triton"
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == greedy_reference(tiny_llama, prompt, 10)[0]
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no preemption forced"
    assert any(o.num_cached_tokens > 0 for o in outs), "no prefix-cache hit"


def test_a_decode_batch_padded_for_a_cuda_graph_changes_no_real_row():
    """What a graph replay runs: the step's decodes padded to the bucket size with rows
    that write nothing (slot -1) and read block 0. The real rows' outputs and the cache
    are exactly those of the unpadded step."""
    from types import SimpleNamespace

    from enginecore.interfaces import AttentionSpec
    from enginecore.layers import Attention
    from enginecore.plugins import make_plugin_manager
    from enginecore.testing.attention_steps import make_batch, write_sequences
    from enginecore_models.cuda_graphs import DecodeGraphs, bucket_sizes

    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert bucket_sizes(1) == [1]
    cls = make_plugin_manager().registry("attention_backend").get("triton")
    spec = AttentionSpec(1, 4, 2, 16, torch.float32, torch.device("cpu"), 4, 64, 8, 64)
    gen = torch.Generator().manual_seed(3)
    lens = [9, 4, 14]
    tables = [[5, 1, 7], [2, 9], [0, 3, 8, 4]]
    keys = [torch.randn(n + 1, 2, 16, generator=gen) for n in lens]
    values = [torch.randn(n + 1, 2, 16, generator=gen) for n in lens]
    batch = make_batch([1, 1, 1], lens, tables, 4)
    query = torch.randn(3, 4, 16, generator=gen)
    new_k = torch.stack([k[n] for k, n in zip(keys, lens, strict=True)])
    new_v = torch.stack([v[n] for v, n in zip(values, lens, strict=True)])
    layer = Attention(4, 16, 0.25, 2)
    outs, caches = [], []
    for pad in (False, True):
        backend = cls(spec)
        cache = backend.allocate_kv_cache(12)[0]
        write_sequences(cache, keys, values, batch)
        step = batch
        q, k, v = query, new_k, new_v
        if pad:
            runner = SimpleNamespace(get_max_model_len=lambda: 64, block_size=4)
            step = DecodeGraphs._padded(SimpleNamespace(runner=runner), batch, 8)
            assert step.slot_mapping[3:].tolist() == [-1] * 5 and step.num_decodes == 8
            q = torch.cat((query, torch.zeros(5, 4, 16)))
            k = torch.cat((new_k, torch.zeros(5, 2, 16)))
            v = torch.cat((new_v, torch.zeros(5, 2, 16)))
        outs.append(backend.forward(layer, q, k, v, cache, backend.build_metadata(step))[:3])
        caches.append(cache.clone())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "window", "num_blocks"), [("mistral", 8, 20), ("gemma3", None, 40)]
)
def test_sliding_window_groups_on_the_triton_backend(checkpoint_factory, arch, window, num_blocks):
    """KV cache groups under the interpreter: Mistral's one sliding group, Gemma 3's full
    and sliding groups sharing cache tensors, each group's metadata staged apart; prompts
    and outputs past the 8-token window, chunked and prefix-cached."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.hf_reference import greedy_reference

    path = checkpoint_factory(arch, sliding_window=window)
    shared = list(range(40, 56))
    prompts = [[*shared, 5, 6, 7, 8], list(range(100, 124)), [*shared, 9, 10]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(
        path,
        attention_backend="triton",
        dtype="float32",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=4,
        num_blocks_override=num_blocks,
    ) as llm:
        [(backend, groups)] = llm.collective_rpc(
            lambda w: (w.model_runner.attn_backend.name, w.model_runner.kv_cache_group_windows)
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert backend == "triton"
    assert groups == ([8] if arch == "mistral" else [None, 8])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == greedy_reference(path, prompt, 12)[0]
    assert any(o.num_cached_tokens > 0 for o in outs), "no prefix-cache hit"
