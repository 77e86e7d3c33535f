"""Quantized weights beyond GGUF's 32-element blocks, kept quantized by the ``gguf``
linear method: GGUF's K-quants (Q4_K, Q5_K, Q6_K), AWQ and GPTQ 4-bit checkpoints, and
``quantization="int8"`` for float checkpoints."""

from __future__ import annotations

import ctypes
import pathlib
import platform
import shutil
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from enginecore.block_formats import kquant_blocks
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.distributed import SINGLE_RANK
from enginecore.layers.linear import QKVParallelLinear, RowParallelLinear, use_linear_method
from enginecore.layers.quantized import QuantizedTensor
from enginecore.testing.quantizers import (
    dequantize_groups,
    quantize_groups,
    quantize_k,
    write_group_quantized,
)
from enginecore_cpu import (
    cpu_kernels,
    gguf_linear_method,
    kquant_kernels,
    quant_gemm,
    quant_kernels,
)
from enginecore_cpu.gguf_linear_method import (
    DIRECT_MAX_ROWS,
    GGUFLinearMethod,
    dequantized_part,
)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

from tests.helpers.hf_reference import greedy_reference  # noqa: E402
from tests.helpers.kernel_builds import build_for  # noqa: E402

needs_kernels = pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler")
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")


def k_tensor(weight: torch.Tensor, fmt: str) -> tuple[QuantizedTensor, torch.Tensor]:
    """``weight`` as GGUF ``fmt`` super-blocks, and what gguf's reference code
    de-quantizes them to."""
    raw = quantize_k(weight, fmt)
    reference = np.array(gguf_quants.dequantize(raw, GGMLQuantizationType[fmt]), np.float32)
    data = torch.from_numpy(raw)
    return QuantizedTensor(data, fmt, tuple(weight.shape)), torch.from_numpy(reference).reshape(
        weight.shape
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# --- GGUF K-quants ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quants_unpack_as_gguf_dequantizes(fmt: str):
    torch.manual_seed(0)
    loaded, reference = k_tensor(torch.randn(48, 512), fmt)
    part = gguf_linear_method.unpacked(loaded)
    assert torch.equal(dequantized_part(part), reference)
    assert isinstance(part, KQuantWeight) and part.fmt == fmt


def test_a_k_quant_row_not_of_whole_super_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        kquant_blocks.from_gguf(torch.zeros(1, 144, dtype=torch.uint8), "Q4_K", (1, 128))


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 12, DIRECT_MAX_ROWS + 1])
@pytest.mark.parametrize("gemm", [True, False])
def test_k_quant_blocks_multiply_as_the_dequantized_weight(
    fmt: str, rows: int, gemm: bool, monkeypatch
):
    """Integer dot products, the one-row kernels' and ``quant_gemm``'s (the activations'
    8-bit rounding is the only difference); without ``quant_gemm``, more rows than the
    one-row kernels take: one GEMM on tiles de-quantized per call (exact)."""
    if not gemm:
        monkeypatch.setattr(quant_gemm.library, "serving", lambda: None)
    torch.manual_seed(1)
    layer = _layer(
        lambda: RowParallelLinear(512, 64, bias=True, parallel=SINGLE_RANK, dtype=torch.float32)
    )
    loaded, reference = k_tensor(torch.randn(64, 512), fmt)
    bias = torch.randn(64)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], loaded)
    params["bias"].weight_loader(params["bias"], bias)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.gguf_blocks and layer.weight.numel() == 0  # the blocks alone
    x = torch.randn(rows, 512)
    err = relative_error(layer(x), F.linear(x, reference, bias))
    assert err < (1e-5 if rows > DIRECT_MAX_ROWS and not gemm else 1e-2), err


# The K-quant kernels, which form each sub-block's float32 scale from the file's scales
# as they go, against products over the same values with float32 scales kept beside them:
# Q5_K / Q6_K against tests/models/kquant_byte_reference.c (one byte a value, a scale per 16, an
# offset per 32), Q4_K against quant_kernels' 4-bit blocks with float32 scales and
# offsets. Built for the same instruction set: equal bit for bit.
_X86 = platform.machine().lower() in ("x86_64", "amd64")
_LEVELS = ["host", *(["x86-64-v3", "x86-64"] if _X86 else [])]


def _build(level: str, directory: pathlib.Path, *sources: pathlib.Path) -> list:
    """``sources`` compiled for ``level`` (the x86-64 level, or ``host``: what the engine
    builds here; ``x86-64`` takes the plain C loops), loaded: the engine's own sources
    through its kernel cache, a test's source in ``directory``."""
    libs = []
    for source in sources:
        if source.parent == kquant_kernels.SOURCE.parent:
            libs.append(build_for(level, source))
            continue
        shutil.copy(kquant_kernels.SOURCE.with_name("quant_simd.h"), directory)
        libs.append(build_for(level, pathlib.Path(shutil.copy(source, directory)), directory))
    return libs


def _byte_layout(part: KQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``part`` as the reference takes it: signed bytes, a scale per 16, an offset per 32."""
    out, k = part.shape
    q = kquant_blocks.values(part).to(torch.int8).contiguous()
    d, m = kquant_blocks.float_scales(part)
    if part.bits == 5:
        return q, d.repeat_interleave(2, dim=-1).contiguous(), m
    return q, d, torch.zeros(out, k // 32)


def _p(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _bit_exact_cases(*formats: str) -> list[tuple[str, tuple[int, int], int]]:
    """(format, weight shape, OpenMP threads): odd and even row counts, one and several
    super-blocks a row (an odd number: Q4_K's offsets go 16 blocks at a time), each on one
    thread and on two."""
    return [
        (fmt, shape, threads)
        for fmt in formats
        for shape in ((13, 512), (3, 256), (6, 1280))
        for threads in (1, 2)
    ]


def _k_part(fmt: str, n: int, k: int, high: str = kquant_blocks.PLANES) -> KQuantWeight:
    raw = torch.from_numpy(quantize_k(torch.randn(n, k), fmt))
    return kquant_blocks.from_gguf(raw, fmt, (n, k), high)


def _activations(k: int, threads: int):
    """(rows, activations) for every row count the block kernels serve (every tail of the
    four-row tiles), blocks of unlike scales, computed on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, DIRECT_MAX_ROWS + 1):
            yield rows, torch.randn(rows, k) * torch.logspace(-2, 2, k)
    finally:
        torch.set_num_threads(before)


def _outputs(rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two output buffers of a row stride beyond the outputs, NaN to show what is written."""
    return torch.full((rows, n + 3), float("nan")), torch.full((rows, n + 3), float("nan"))


@needs_kernels
@pytest.mark.parametrize("level", _LEVELS)
def test_q5_k_and_q6_k_multiply_as_float32_scales_bit_for_bit(level, tmp_path):
    reference_source = pathlib.Path(__file__).with_name("kquant_byte_reference.c")
    kernel, reference = _build(level, tmp_path, kquant_kernels.SOURCE, reference_source)
    torch.manual_seed(5)
    i64 = ctypes.c_int64
    # One activation row on AVX-512 or AVX2 runs the one-row kernel, whose sums go a
    # vector at a time, in their own order (tests/cpu/test_block_kernel_variants.py
    # checks it against gguf's values); the plain C build has none.
    built_for = cpu_kernels.instruction_set() if level == "host" else level
    one_row_kernel = built_for in ("x86-64-v4", "x86-64-v3")
    # the AVX2 build keeps Q5_K's and Q6_K's high bits packed: the same values, the same bits
    high = kquant_blocks.PACKED if built_for == "x86-64-v3" else kquant_blocks.PLANES
    for fmt, (n, k), threads in _bit_exact_cases("Q5_K", "Q6_K"):
        part = _k_part(fmt, n, k, high)
        q, d, m = _byte_layout(part)
        for rows, x in _activations(k, threads):
            if rows == 1 and one_row_kernel:
                continue
            acts = quant_kernels.load().quantize_rows(x)
            got, want = _outputs(rows, n)
            common = (_p(acts.q), _p(acts.scale), _p(acts.scaled_sum))
            kernel.eck_gemm_k(
                i64(rows), i64(n), i64(k), i64(part.bits), _p(part.qs), _p(part.scales),
                *common, _p(got), i64(n + 3),
            )  # fmt: skip
            reference.eck_gemm_s16_bytes(
                i64(rows), i64(n), i64(k), _p(q), _p(d), _p(m), *common, _p(want), i64(n + 3)
            )
            assert torch.equal(got[:, :n], want[:, :n]), (fmt, rows, threads)
            assert got[:, n:].isnan().all()  # nothing written past the outputs


@needs_kernels
@pytest.mark.parametrize("level", _LEVELS)
def test_q4_k_multiplies_as_float32_scales_bit_for_bit(level, tmp_path):
    (kernel,) = _build(level, tmp_path, quant_kernels.SOURCE)
    kernel.ecq_linear.restype = ctypes.c_int
    torch.manual_seed(8)
    i64 = ctypes.c_int64
    for _, (n, k), threads in _bit_exact_cases("Q4_K"):
        part = _k_part("Q4_K", n, k)
        wide = kquant_blocks.four_bit_blocks(part)  # float32 scales and offsets
        for rows, x in _activations(k, threads):
            got, want = _outputs(rows, n)
            for weight, out in ((part, got), (wide, want)):
                qs, d, m = (ctypes.c_void_p(a) for a in weight.pointers)
                status = kernel.ecq_linear(
                    ctypes.c_int(weight.kind), _p(x), i64(k), i64(rows), i64(n), i64(k),
                    qs, d, m, _p(out), i64(n + 3),
                )  # fmt: skip
                assert status == 0
            assert torch.equal(got[:, :n], want[:, :n]), (rows, threads)
            assert got[:, n:].isnan().all()


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q5_K", "Q6_K"])
def test_the_block_kernel_refuses_a_5_or_6_bit_k_quant(fmt: str):
    """``ecq_linear`` would read a Q5_K / Q6_K part's scale bytes as float32 scales, past
    their end: the 5- and 6-bit kernel is theirs."""
    part = _k_part(fmt, 4, 256)
    with pytest.raises(ValueError, match="Q5_K / Q6_K"):
        quant_kernels.load().linear(torch.randn(1, 256), part, torch.empty(1, 4))


@needs_kernels
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_k_quants_are_held_at_the_file_width(fmt: str):
    """Values and scales take the file's bits (4.5, 5.5, 6.5625 a value) and de-quantize,
    in C, to the file's values."""
    torch.manual_seed(6)
    loaded, reference = k_tensor(torch.randn(32, 1024), fmt)
    part = gguf_linear_method.unpacked(loaded)
    assert part.nbytes * 8 / (32 * 1024) == {"Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625}[fmt]
    assert part.nbytes == loaded.data.nbytes  # the file's bytes, rearranged
    assert torch.equal(gguf_linear_method._dequantize_with(quant_kernels.load(), part), reference)


@needs_kernels
def test_fused_qkv_of_q5_k_and_q6_k_keeps_each_layout():
    """Adjacent shards of one layout are multiplied as one part, of two layouts as two."""
    torch.manual_seed(7)
    layer = _layer(
        lambda: QKVParallelLinear(
            256, 16, 8, 4, bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    parts = []
    for shard, rows, fmt in (("q", 128, "Q5_K"), ("k", 64, "Q5_K"), ("v", 64, "Q6_K")):
        loaded, reference = k_tensor(torch.randn(rows, 256), fmt)
        params["weight"].weight_loader(params["weight"], loaded, shard)
        parts.append(reference)
    layer.linear_method.process_weights_after_loading(layer)
    assert [(first, p.bits) for first, p in layer.gguf_blocks] == [(0, 5), (192, 6)]
    for rows in (2, DIRECT_MAX_ROWS + 3):
        x = torch.randn(rows, 256)
        assert relative_error(layer(x), F.linear(x, torch.cat(parts))) < 1e-2


@needs_kernels
def test_fused_qkv_of_q4_k_and_q6_k():
    """Q and K in Q4_K, V in Q6_K (as llama.cpp's Q4_K_M mixes them) in one layer."""
    torch.manual_seed(2)
    layer = _layer(
        lambda: QKVParallelLinear(
            256, 16, 8, 4, bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    parts = []
    for shard, rows, fmt in (("q", 128, "Q4_K"), ("k", 64, "Q4_K"), ("v", 64, "Q6_K")):
        loaded, reference = k_tensor(torch.randn(rows, 256), fmt)
        params["weight"].weight_loader(params["weight"], loaded, shard)
        parts.append(reference)
    layer.linear_method.process_weights_after_loading(layer)
    assert [(first, p.fmt) for first, p in layer.gguf_blocks] == [(0, "Q4_K"), (192, "Q6_K")]
    for rows in (2, DIRECT_MAX_ROWS + 3):
        x = torch.randn(rows, 256)
        assert relative_error(layer(x), F.linear(x, torch.cat(parts))) < 1e-2


def _layer(factory: Any, config: Any = None) -> Any:
    with use_linear_method(GGUFLinearMethod(config)):
        return factory()


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: V and the down projection in Q6_K, the rest in Q4_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


@needs_kernels
@pytest.mark.slow
def test_a_q4_k_m_gguf_answers_as_dequantized(tiny_llama, tmp_path, monkeypatch):
    """A GGUF file mixing Q4_K and Q6_K loads with its blocks kept, and decodes greedily
    as the same file de-quantized at load does."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.gguf_writer import write_gguf

    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    kept: set[str] = set()
    monkeypatch.setattr(GGUFLinearMethod, "process_weights_after_loading", _recording(kept))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    answers = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), quantization=quantization, multiprocessing=False)
        try:
            out = llm.generate({"prompt_token_ids": list(range(3, 40))}, params)
            answers[quantization] = out[0].outputs[0].token_ids
        finally:
            llm.shutdown()
    assert kept == {"Q4_K", "Q6_K"}, kept  # the LM head too: the file's Q4_K blocks
    assert answers["auto"][:4] == answers["none"][:4], answers


def _recording(kinds: set[str]):
    """``process_weights_after_loading`` that notes the kinds of blocks layers keep (a
    K-quant's format, else the class)."""
    original = GGUFLinearMethod.process_weights_after_loading

    def record(self, layer):
        original(self, layer)
        for _, part in getattr(layer, "gguf_blocks", None) or []:
            kinds.add(getattr(part, "fmt", type(part).__name__))

    return record


# --- AWQ / GPTQ ---------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_group_quantized_tensors_unpack_to_their_weight(method: str, symmetric: bool):
    from enginecore.testing.quantizers import awq_tensors, gptq_tensors
    from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized

    torch.manual_seed(3)
    weight = torch.randn(48, 256)
    q, scales, zeros = quantize_groups(weight, 64, symmetric)
    if method == "gptq":
        zeros = zeros.clamp(min=1)
        parts = gptq_tensors(q, scales, zeros)
    else:
        parts = awq_tensors(q, scales, zeros)
    reference = dequantize_groups(q, scales, zeros)
    assert (reference - weight).abs().max() < 0.5  # the quantizer itself is sane
    qc = GroupQuantConfig(method, 64, 1 if method == "gptq" else 0)
    tensors = [(f"layer.proj.{leaf}", t) for leaf, t in parts.items()] + [("norm.weight", q)]
    as_float = dict(iter_group_quantized(iter(tensors), qc, blocks=False))
    torch.testing.assert_close(as_float["layer.proj.weight"], reference, rtol=0, atol=1e-6)
    assert "norm.weight" in as_float and "layer.proj.qweight" not in as_float
    blocks = dict(iter_group_quantized(iter(tensors), qc, blocks=True))["layer.proj.weight"]
    part = gguf_linear_method.unpacked(blocks)
    torch.testing.assert_close(dequantized_part(part), reference, rtol=0, atol=1e-6)


def test_gptq_with_a_reordering_g_idx_is_refused():
    from enginecore.errors import UnsupportedModelError
    from enginecore.testing.quantizers import gptq_tensors
    from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized

    q, scales, zeros = quantize_groups(torch.randn(16, 128), 64, False)
    parts = gptq_tensors(q, scales, zeros.clamp(min=1))
    parts["g_idx"] = torch.randperm(128, generator=torch.Generator().manual_seed(0)) // 64
    with pytest.raises(UnsupportedModelError, match="desc_act"):
        list(iter_group_quantized(iter(parts.items()), GroupQuantConfig("gptq", 64, 1), True))


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group_size=48"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero"),
    ],
)
def test_unsupported_group_settings_are_refused_naming_them(settings, named):
    from types import SimpleNamespace

    from enginecore.errors import UnsupportedModelError
    from enginecore_models.group_quant import group_quant_config

    with pytest.raises(UnsupportedModelError, match=named):
        group_quant_config(SimpleNamespace(quantization_config=settings))


@pytest.fixture(scope="module")
def group_checkpoints(tmp_path_factory, checkpoint_factory) -> dict[str, tuple[pathlib.Path, ...]]:
    source = checkpoint_factory("llama")
    root = tmp_path_factory.mktemp("group-quantized")
    made = {}
    for method, symmetric in (("awq", False), ("gptq", False), ("gptq", True)):
        name = f"{method}-{'sym' if symmetric else 'asym'}"
        quantized, reference = root / name, root / f"{name}-dequantized"
        write_group_quantized(source, quantized, reference, method, 64, symmetric)
        made[name] = (quantized, reference)
    return made


def _model_logits(
    path: pathlib.Path, quantized: bool, ids: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    """Logits of one forward over ``ids`` of the checkpoint at ``path``, its projections
    through the ``gguf`` method (``quantized``) or in float32."""
    from enginecore.layers.torch_attention import TorchAttentionBackend
    from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context
    from enginecore_models.models.llama import LlamaForCausalLM
    from enginecore_models.weight_loader import iter_weights, load_hf_config

    cfg = load_hf_config(path)
    keep = GGUFLinearMethod.gguf_formats if quantized else ()
    with use_linear_method(GGUFLinearMethod(None)):
        model = LlamaForCausalLM(cfg)
    model.load_weights(iter_weights(path, cfg, keep))
    for layer in model.modules():
        if hasattr(layer, "linear_method"):
            layer.linear_method.process_weights_after_loading(layer)
    backend = TorchAttentionBackend(spec_for_model(model, block_size=16))
    blocks = -(-len(ids) // 16)
    kv = backend.allocate_kv_cache(blocks + 1)
    ctx = step_context(backend, make_batch([len(ids)], [0], [list(range(blocks))], 16))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), kv, ctx)), model


@needs_kernels
@pytest.mark.parametrize("name", ["awq-asym", "gptq-asym", "gptq-sym"])
def test_group_quantized_logits_match_the_dequantized_weights(group_checkpoints, name, monkeypatch):
    """Every row through integer kernels (the 24-row prefill through ``quant_gemm``, or
    the one-row kernels as decode steps compute): the largest logit difference against
    the de-quantized weights in float32 stays at the activations' 8-bit rounding."""
    monkeypatch.setattr(gguf_linear_method, "DIRECT_MAX_ROWS", 1 << 30)
    quantized, reference = group_checkpoints[name]
    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(0))
    got, model = _model_logits(quantized, True, ids)
    want, _ = _model_logits(reference, False, ids)
    assert model.model.layers[0].self_attn.qkv_proj.gguf_blocks  # kept in blocks
    worst = (got - want).abs().max()
    assert worst < 0.05 * want.abs().max()
    # A greedy choice differs only where the reference's own margin is within the error.
    rows = torch.arange(len(ids))
    margin = want[rows, want.argmax(-1)] - want[rows, got.argmax(-1)]
    assert (margin <= 2 * worst).all()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.75


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("name", ["awq-asym", "gptq-sym"])
def test_group_quantized_checkpoint_decodes_as_transformers(group_checkpoints, name, monkeypatch):
    """Through ``LLM``: kept in blocks (de-quantize + GEMM for every row, exact: no
    ``quant_gemm``, no one-row kernels, no fused decode step: its products are the
    one-row kernels') and, through the torch path (``quantization="none"``, as off CPU),
    de-quantized at load; both decode greedily as transformers does on the de-quantized
    float32 weights."""
    from enginecore import LLM, SamplingParams

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "0")
    monkeypatch.setattr(gguf_linear_method, "DIRECT_MAX_ROWS", -1)
    monkeypatch.setattr(quant_gemm.library, "serving", lambda: None)
    quantized, reference = group_checkpoints[name]
    prompt = list(range(3, 20))
    want, first_tie = greedy_reference(reference, prompt, 12)
    kinds: set[str] = set()
    monkeypatch.setattr(GGUFLinearMethod, "process_weights_after_loading", _recording(kinds))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for quantization in ("auto", "none"):
        llm = LLM(str(quantized), quantization=quantization, multiprocessing=False)
        try:
            got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        finally:
            llm.shutdown()
        assert list(got)[: first_tie + 1] == want[: first_tie + 1], quantization
    assert kinds == {"BlockWeight"}


# --- int8 ---------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("gemm", [True, False])
def test_int8_per_channel_of_a_float_layer(gemm: bool, monkeypatch):
    from types import SimpleNamespace

    if not gemm:
        monkeypatch.setattr(quant_gemm.library, "serving", lambda: None)
    torch.manual_seed(4)
    config = SimpleNamespace(model=SimpleNamespace(quantization="int8"))
    layer = _layer(
        lambda: RowParallelLinear(256, 96, bias=False, parallel=SINGLE_RANK, dtype=torch.float32),
        config,
    )
    weight = torch.randn(96, 256) * torch.linspace(0.1, 3, 96).unsqueeze(1)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], weight)
    layer.linear_method.process_weights_after_loading(layer)
    ((_, part),) = layer.gguf_blocks
    assert part.bits == 8 and layer.weight.numel() == 0
    scale = weight.abs().amax(1, keepdim=True) / 127
    reference = torch.round(weight / scale).clamp(-127, 127) * scale
    torch.testing.assert_close(dequantized_part(part), reference)
    for rows in (1, 8, DIRECT_MAX_ROWS + 1):
        x = torch.randn(rows, 256)
        err = relative_error(layer(x), F.linear(x, reference))
        assert err < (1e-5 if rows > DIRECT_MAX_ROWS and not gemm else 1e-2), err


@needs_kernels
@pytest.mark.slow
def test_int8_quantization_of_a_float_checkpoint(tiny_llama, monkeypatch):
    """``quantization="int8"`` keeps a float checkpoint's projections in int8 and answers
    as the float model; ``auto`` leaves them float."""
    from enginecore import LLM, SamplingParams

    kinds: set[str] = set()
    monkeypatch.setattr(GGUFLinearMethod, "process_weights_after_loading", _recording(kinds))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 20))
    want, first_tie = greedy_reference(tiny_llama, prompt, 6)
    llm = LLM(str(tiny_llama), quantization="int8", multiprocessing=False)
    try:
        got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert kinds == {"BlockWeight"}
    assert list(got)[: min(first_tie + 1, 3)] == want[: min(first_tie + 1, 3)]
    kinds.clear()
    llm = LLM(str(tiny_llama), multiprocessing=False)
    llm.shutdown()
    assert kinds == set()  # auto: float checkpoints stay float (cpu_packed)


def test_scales_not_matching_the_configured_group_size_are_refused():
    from enginecore.errors import UnsupportedModelError
    from enginecore.testing.quantizers import awq_tensors
    from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized

    parts = awq_tensors(*quantize_groups(torch.randn(16, 256), 64, False))
    tensors = [(f"proj.{leaf}", t) for leaf, t in parts.items()]
    with pytest.raises(UnsupportedModelError, match=r"proj.*group_size=128"):
        list(iter_group_quantized(iter(tensors), GroupQuantConfig("awq", 128, 0), True))
