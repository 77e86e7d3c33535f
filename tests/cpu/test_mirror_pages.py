"""The decode mirror in chunks of whole 2 MiB pages (``mirror_layout.py``): the kernels and
the torch path read and write the chunks as the dense layout; a long row is mapped in huge
pages; a short context keeps only its positions' small pages resident."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import cpu_kernels, decode_step, mirror_layout
from enginecore_cpu.decode_mirror import DecodeMirror
from enginecore_cpu.host_memory import HUGE_PAGE, mappings_under, zeroed
from enginecore_cpu.mirror_layout import MirrorLayout

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

BLOCK = 16  # the paged cache's block size


def _paged(layers: int, heads: int, dim: int, dtype: torch.dtype, blocks: int, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, blocks, BLOCK, heads, dim)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]


def _context(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """A request's first ``length`` positions in the paged cache: [2, heads, length, dim]."""
    kv = cache[:, blocks].flatten(1, 2)[:, :length]
    return kv.transpose(1, 2)


def _reference(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int):
    """One row's query heads [hq, dim] over its K and V [hkv, length, dim] in float32."""
    if window:
        k, v = k[:, -window:], v[:, -window:]
    group = query.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(query[:, None], k, v, scale=scale)[:, 0]


def _mirror(
    heads: int, dim: int, dtype: torch.dtype, max_len: int, rows: int, layers: int = 1
) -> DecodeMirror:
    return DecodeMirror(layers, heads, dim, dtype, torch.device("cpu"), 1 << 40, max_len, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hkv,dim", [(64, 32, 64), (32, 16, 128), (48, 16, 96)])
@pytest.mark.parametrize("window", [0, 100])
def test_attention_over_the_chunks_is_sdpa_over_the_context(
    hq, hkv, dim, dtype, window, monkeypatch
):
    """Rows whose contexts cross chunk boundaries (chunks of one huge page a layer: 64 to
    512 positions at these shapes, the fast kernels' and the generic one's), filled from
    the paged cache, appended to and attended: the kernels' path and the torch path (a
    float64 query) give SDPA's result over each row's context and new token."""
    monkeypatch.setattr(mirror_layout, "CHUNK_BYTES", HUGE_PAGE)
    lens = [5, 130, 300, 700]
    nb = -(-max(lens) // BLOCK) + 1
    (cache,) = _paged(1, hkv, dim, dtype, nb * len(lens), seed=hq + dim)
    tables = {str(i): list(range(i * nb, (i + 1) * nb)) for i in range(len(lens))}
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(len(lens), hq, dim, generator=gen)
    key, value = torch.randn(2, len(lens), hkv, dim, generator=gen)
    layout = MirrorLayout.plan(1, hkv, dim, dtype, len(lens), 1024)
    assert layout.huge and layout.chunk < max(lens), layout  # the rows span chunks
    outs = []
    for wide in (torch.float32, torch.float64):  # the kernels, then the torch path
        mirror = _mirror(hkv, dim, dtype, 1024, len(lens))
        order = mirror.plan(list(tables), np.array(lens), tables.__getitem__, [cache])
        assert order == list(tables)
        outs.append(
            mirror.attend(
                query.to(wide), key.to(wide), value.to(wide), cache, dim**-0.5, window or None
            ).float()
        )
    for r, length in enumerate(lens):
        context = _context(cache, tables[str(r)], length)
        k = torch.cat([context[0], key[r, :, None].to(dtype)], dim=1)
        v = torch.cat([context[1], value[r, :, None].to(dtype)], dim=1)
        want = _reference(query[r], k, v, dim**-0.5, window)
        for out in outs:
            torch.testing.assert_close(out[r], want, rtol=1e-4, atol=5e-5)


def test_the_fused_steps_attention_reads_the_chunks(monkeypatch):
    """The fused step attends a (row, KV head) span by span (ec_attend_span), spans that
    cross chunk boundaries included, as the layers' kernel does."""
    monkeypatch.setattr(mirror_layout, "CHUNK_BYTES", HUGE_PAGE)
    hkv, dim, group = 32, 64, 2
    lib = ctypes.CDLL(str(decode_step.build()))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ec_attention_spans.argtypes, lib.ec_attention_spans.restype = [i64], i64
    lib.ec_attend_span.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, i64, i64,
                                   ptr, ctypes.c_int]  # fmt: skip
    lib.ec_merge_spans.argtypes = [ptr, i64, i64, i64, ptr]
    memory = mirror_layout.MirrorMemory(
        MirrorLayout.plan(1, hkv, dim, torch.float32, 1, 600), torch.float32
    )
    layer = memory.layers[0]
    dense = torch.randn(2, 1, hkv, 600, dim)
    mirror_layout.write_positions(layer, slice(0, 1), 0, dense)
    at = mirror_layout.geometry(layer)
    query = torch.randn(1, hkv * group, dim)
    want = cpu_kernels.load().decode_attention(query, layer, torch.tensor([600]), 0.1, None)
    spans = lib.ec_attention_spans(600)
    parts = torch.empty(spans, group * dim + 2 * group)
    head = at.chunk * dim * 4
    for kh in range(hkv):
        q = query[0, kh * group : (kh + 1) * group].contiguous()
        for j in range(spans):
            lib.ec_attend_span(
                q.data_ptr(), at.k + kh * head, at.v + kh * head, 600 * j // spans,
                600 * (j + 1) // spans, at.chunk, at.chunk_stride, 0.1, group, dim,
                parts[j].data_ptr(), 0,
            )  # fmt: skip
        out = torch.empty(group, dim)
        lib.ec_merge_spans(parts.data_ptr(), spans, group, dim, out.data_ptr())
        assert torch.equal(out, want[0, kh * group : (kh + 1) * group])


def _anonymous_memory_maps_in_huge_pages() -> bool:
    """Whether this kernel gives anonymous memory advised MADV_HUGEPAGE huge pages."""
    probe = zeroed((4 * HUGE_PAGE,), torch.uint8, torch.device("cpu"))
    base = probe.data_ptr()
    aligned = -base % HUGE_PAGE
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(base + aligned, 2 * HUGE_PAGE, getattr(mmap, "MADV_HUGEPAGE", 14))
    probe[aligned : aligned + 2 * HUGE_PAGE].fill_(1)
    return bool(mappings_under(probe).get("AnonHugePages", 0) > 0)


# A shape whose mirror chunk holds 1,024 positions (32 KV heads of 64 floats, the 1.7B
# Llama shape's), two layers.
LAYERS, HEADS, DIM = 2, 32, 64


def _grow(mirror: DecodeMirror, caches: list[torch.Tensor], lengths: list[int], steps: int):
    """Requests of ``lengths`` joining the mirror (filled from the paged cache), then
    ``steps`` decode steps appending a token to each row in every layer."""
    ids = [str(i) for i in range(len(lengths))]
    nb = caches[0].shape[1] // len(lengths)
    tables = {rid: list(range(i * nb, (i + 1) * nb)) for i, rid in enumerate(ids)}
    kernels = cpu_kernels.load()
    lens = np.array(lengths)
    for _ in range(steps + 1):
        order = mirror.plan(ids, lens, tables.__getitem__, caches)
        assert order == ids
        step = mirror.step
        assert step is not None
        new = torch.ones(len(ids), HEADS, DIM)
        for layer in mirror.layers:
            kernels.mirror_append(layer, new, new, step.lens)
        lens = lens + 1


@pytest.mark.parametrize("max_bytes", [1 << 40, 100 << 20], ids=["every-row", "growing"])
def test_a_long_row_of_the_mirror_is_mapped_in_huge_pages(max_bytes):
    """A row filled with 1,000 positions has its first chunk (1,024 positions) in 2 MiB
    pages, collapsed once half full; decoding 100 more, the next chunk is faulted in huge
    as the row reaches it. ``growing``: a memory bound too small for every row at full
    length, so the mirror is sized to the rows and regrown (as for a model whose
    ``max_model_len`` the KV cache cannot hold for every sequence): its capacity is whole
    chunks too. Before, the mirror was all 4 KiB pages; a regrown mirror was dense until
    its capacity passed a chunk."""
    if not _anonymous_memory_maps_in_huge_pages():
        pytest.skip("this kernel gives anonymous memory no huge pages (THP off?)")
    caches = _paged(LAYERS, HEADS, DIM, torch.float32, 80, seed=1)
    mirror = DecodeMirror(
        LAYERS, HEADS, DIM, torch.float32, torch.device("cpu"), max_bytes, 2048, 4
    )
    layout = MirrorLayout.plan(LAYERS, HEADS, DIM, torch.float32, 4, 2048)
    assert layout.chunk == 1024
    chunk = layout.chunk_elems * layout.itemsize
    _grow(mirror, caches, [1000], 0)
    assert mirror.memory is not None
    assert mirror.memory.layout.rows == (1 if max_bytes < 1 << 30 else 4)
    mirror.memory.settle()  # the first chunk's small pages, collapsed in the background
    assert mappings_under(mirror.layers[0])["AnonHugePages"] >= chunk
    _grow(mirror, caches, [1001], 100)  # the same request: 1,101 positions
    mirror.memory.settle()
    assert mappings_under(mirror.layers[0])["AnonHugePages"] >= 2 * chunk


def test_a_short_context_keeps_only_its_positions_resident():
    """Four requests of 60-100 positions (under half a chunk) keep no more resident than
    their positions' 4 KiB pages: each (row, layer, K or V, KV head) run of a row's first
    chunk is ``ceil(length * head_dim * 4 / 4096)`` pages. Huge pages there would make a
    whole 2 MiB page resident per row, layer and K/V, whatever the context; and the
    mirror is advised MADV_NOHUGEPAGE (VmFlags ``nh``) until a row grows into a chunk, so
    this holds where THP is ``always`` too. Before, no advice: THP ``always`` made a
    short row's every head's positions a huge page each (one capacity apart)."""
    lengths = [60, 80, 90, 100]
    caches = _paged(LAYERS, HEADS, DIM, torch.float32, 4 * 8, seed=2)
    mirror = _mirror(HEADS, DIM, torch.float32, 2048, 8, LAYERS)
    _grow(mirror, caches, lengths, 3)
    assert "nh" in mappings_under(mirror.layers[0])["VmFlags"]
    page = mmap.PAGESIZE
    bound = sum(
        LAYERS * 2 * HEADS * -(-(length + 4) * DIM * 4 // page) * page for length in lengths
    )
    resident = mappings_under(mirror.layers[0])["Rss"]
    assert 0 < resident <= bound, (resident, bound)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "layers"])
def test_a_mirror_in_chunks_decodes_greedy_as_transformers(tiny_llama, monkeypatch, fused):
    """The engine with the tiny model's mirror in chunks of 32 positions (a smaller chunk
    than a huge page, so that its rows span several): each request's greedy tokens are
    transformers' ``generate``, with the fused step and with the layers."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.hf_reference import greedy_reference

    monkeypatch.setattr(mirror_layout, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
    prompts = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 41, 12))]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama), multiprocessing=False, max_model_len=256, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.engine_client.engine.executor.worker.model_runner
        memory = runner.attn_backend.mirror.memory
        assert memory is not None and memory.layout.chunk == 32 and memory.layout.chunks == 8
        steps = getattr(runner.fused_decode, "steps", 0)
        assert (steps >= 30) if fused else not steps, steps
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, first_tie = greedy_reference(tiny_llama, prompt, 40)
        assert out.outputs[0].token_ids[:first_tie] == tokens[:first_tie]
