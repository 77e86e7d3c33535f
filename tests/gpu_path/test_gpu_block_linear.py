"""The ``gguf_triton`` linear method (``builtin_gpu``): quantized blocks kept on the GPU and
multiplied by Triton kernels, run here on the CPU by Triton's interpreter.

The kernels are checked against the weight the blocks stand for (de-quantized by the CPU
method's torch code) rounded to the activations' dtype, which is what the kernel multiplies
on a GPU: products are exact in float32, so only the order of the sums and the output's
rounding differ. For bf16 the interpreter's kernel widens its tiles to float32 before the
product (the interpreter multiplies bf16 operands as their raw bit patterns), so there the
weight is not rounded; and it rounds float32 to bf16 by truncation, hence bf16's tolerance
of two units in the last place. Code the interpreter accepts but a GPU compiler would reject is
caught by a slow test that compiles the kernels for NVIDIA sm_90 and AMD gfx942 with the
compilers shipped in the triton wheel; ``benchmarks/gpu_check.py`` runs them on a GPU.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

# The interpreter is chosen when a @triton.jit function is defined, so this must precede the
# import of the kernels' module.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from enginecore.block_formats import gguf_blocks, kquant_blocks
from enginecore.block_formats import parts as block_parts
from enginecore.block_formats.gguf_blocks import BlockWeight
from enginecore.distributed import SINGLE_RANK
from enginecore.errors import ConfigError
from enginecore.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    use_linear_method,
)
from enginecore.layers.quantized import QuantizedTensor
from enginecore.layers.selection import registered_refs, select_linear_method
from enginecore.testing import LinearMethodContract
from enginecore.testing.quantizers import quantize_groups, quantize_k
from enginecore_gpu import block_kernels, block_linear_method
from enginecore_gpu.block_linear_method import GGUFTritonLinearMethod
from enginecore_models.model_runner import linear_method_name

if not block_kernels.is_interpreted():  # imported earlier in this process without the flag
    block_kernels = importlib.reload(block_kernels)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Units in the last place of each dtype's output (bf16: the interpreter truncates).
OUTPUT_ULP = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def gguf_tensor(weight: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``weight`` as a GGUF tensor of format ``fmt``, quantized by gguf's own code (the
    K-quants by the test kit's quantizer)."""
    if fmt in kquant_blocks.FORMATS:
        raw = quantize_k(weight, fmt)
    else:
        raw = gguf_quants.quantize(weight.float().numpy(), GGMLQuantizationType[fmt])
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(weight.shape[0], -1)
    return QuantizedTensor(data, fmt, tuple(weight.shape))


GROUP_FORMATS = ("awq", "gptq", "gptq-sym")


def group_tensor(weight: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``weight`` as an AWQ or GPTQ checkpoint's packed tensors (groups of 64 where K allows,
    else 32; zero points, or GPTQ's symmetric 8), read as the loader reads them: 4-bit
    blocks of 32."""
    from enginecore.testing.quantizers import awq_tensors, gptq_tensors
    from enginecore_models.group_quant import GroupQuantConfig, iter_group_quantized

    method = fmt.split("-")[0]
    group = 64 if weight.shape[1] % 64 == 0 else 32
    q, scales, zeros = quantize_groups(weight, group, fmt.endswith("sym"))
    if method == "gptq":
        parts = gptq_tensors(q, scales, zeros.clamp(min=1))
    else:
        parts = awq_tensors(q, scales, zeros)
    config = GroupQuantConfig(method, group, 1 if method == "gptq" else 0)
    tensors = [(f"proj.{leaf}", t) for leaf, t in parts.items()]
    return dict(iter_group_quantized(iter(tensors), config, blocks=True))["proj.weight"]


def blocks_of(fmt: str, out: int, k: int, seed: int = 0) -> BlockWeight:
    weight = torch.randn(out, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int8":
        return block_parts.per_channel_q8(weight)
    if fmt in GROUP_FORMATS:
        return block_parts.unpacked(group_tensor(weight, fmt))
    part = block_linear_method.block_weight(gguf_tensor(weight, fmt))
    assert part is not None
    return part


def check_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """``got`` is ``x W^T`` for the float32 weight ``weight`` as the kernel multiplies it."""
    assert got.dtype == x.dtype
    multiplied = weight if x.dtype == torch.bfloat16 else weight.to(x.dtype)
    want = x.double() @ multiplied.double().t()
    bound = 1e-5 * want.abs().max() + OUTPUT_ULP[x.dtype] * want.abs()
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item():.3g} over the bound ({x.dtype})"


# --- the kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_every_row_count(fmt: str, dtype: torch.dtype):
    """Rows 1 to 17 (one tile of 16 rows, then two), K = 160 (five blocks: a whole tile of
    four and a tail of one), 37 outputs (a whole tile of 32 and a tail)."""
    k = 256 if fmt == "Q4_K" else 160  # a K-quant row is whole super-blocks of 256
    part = blocks_of(fmt, 37, k)
    weight = gguf_blocks.dequantize(part)
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 18):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        check_product(block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m), x, weight)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_many_rows_in_large_tiles(fmt: str, dtype: torch.dtype):
    """A prefill chunk's product: 200 rows (a whole tile of 128 and a tail), 70 outputs (a
    tile of 64 and a tail), K of 5 or 8 blocks (tiles of two blocks, the last one half)."""
    assert block_kernels.tile_for(200)[:3] == (128, 64, 64)
    k = 256 if fmt == "Q4_K" else 160
    part = blocks_of(fmt, 70, k, seed=3)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m)
    check_product(got, x, gguf_blocks.dequantize(part))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "awq", "gptq", "gptq-sym", "int8"])
@pytest.mark.parametrize("shape", [(1, 96), (33, 32), (64, 224)])
@pytest.mark.parametrize("rows", [1, 31, 40])
def test_kernel_shapes_and_formats(fmt: str, shape: tuple[int, int], rows: int):
    """Float16 and float32 scales, with and without offsets; K of 1, 3 and 7 blocks (never
    a whole tile of 128), one output and an odd number (AWQ / GPTQ: a multiple of 8, as
    their words pack 8 outputs); tiles of 16, 32 and 64 rows."""
    out, k = shape
    if fmt in GROUP_FORMATS:
        out = 8 * -(-out // 8)
    part = blocks_of(fmt, out, k, seed=out + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    weight = gguf_blocks.dequantize(part)
    check_product(block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m), x, weight)
    bf16 = x.bfloat16()
    check_product(
        block_kernels.block_linear(bf16, part.bits, part.qs, part.d, part.m), bf16, weight
    )


def test_kernel_writes_into_a_column_slice():
    part = blocks_of("Q4_1", 24, 64)
    x = torch.randn(3, 64)
    out = torch.full((3, 40), 7.0)
    block_kernels.block_linear(x, part.bits, part.qs, part.d, part.m, out[:, 8:32])
    check_product(out[:, 8:32], x, gguf_blocks.dequantize(part))
    assert (out[:, :8] == 7).all() and (out[:, 32:] == 7).all()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "awq"])
def test_dequantize_kernel_is_exact(fmt: str):
    k = 256 if fmt == "Q4_K" else 160
    part = blocks_of(fmt, 40 if fmt == "awq" else 37, k)
    want = gguf_blocks.dequantize(part)
    got = block_kernels.dequantize(part.bits, part.qs, part.d, part.m, torch.float32)
    assert torch.equal(got, want)
    half = block_kernels.dequantize(part.bits, part.qs, part.d, part.m, torch.float16)
    assert torch.equal(half, want.half())


def test_kernel_refuses_what_it_cannot_multiply():
    part = blocks_of("Q4_0", 8, 64)
    with pytest.raises(ValueError, match="activations have 96 inputs"):
        block_kernels.block_linear(torch.randn(2, 96), 4, part.qs, part.d, part.m)
    with pytest.raises(ValueError, match="expected"):
        block_kernels.block_linear(torch.randn(2, 64), 8, part.qs, part.d, part.m)
    with pytest.raises(TypeError, match="float64"):
        block_kernels.block_linear(torch.randn(2, 64).double(), 4, part.qs, part.d, part.m)


COMPILE_FOR_GPUS = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from enginecore_gpu import block_kernels as bk

    def compile_for(kernel, target, constexprs, pointers, num_warps=4):
        signature = {}
        for name in kernel.arg_names:
            if name in constexprs:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointers[name]
            else:
                signature[name] = "i32"
        triton.compile(ASTSource(kernel, signature, constexprs), target=target,
                       options={"num_warps": num_warps})

    for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
        for bits, scales in ((4, "fp16"), (4, "fp32"), (8, "fp32")):
            weight = {"qs_ptr": "*u8" if bits == 4 else "*i8", "d_ptr": "*" + scales,
                      "m_ptr": "*" + scales}
            # Triton turns integer arguments equal to 1 into constants at launch: the bf16
            # variant compiles a decode step's one row as it would see it.
            for act, tile, precision, unit in (("bf16", 0, "tf32", {"M": 1}),
                                               ("fp16", 2, "tf32", {}),
                                               ("bf16", 3, "tf32", {}),
                                               ("fp32", 1, "ieee", {})):
                _, block_m, block_n, block_k, warps = bk.TILES[tile]
                compile_for(
                    bk._block_linear_kernel,
                    target,
                    dict(BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         DOT_IN_FP32=act == "fp32", DOT_PRECISION=precision, **unit),
                    {"x_ptr": "*" + act, "out_ptr": "*" + act, **weight},
                    num_warps=warps,
                )
            compile_for(bk._dequantize_kernel, target,
                        dict(BITS=bits, BLOCK_N=bk._BLOCK_N, BLOCK_K=bk._BLOCK_K),
                        {"out_ptr": "*bf16", **weight})
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
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split("\n")[:2] == ["compiled for cuda", "compiled for hip"]


# --- the linear method -----------------------------------------------------------------


def build(factory: Any, config: Any = None) -> Any:
    with use_linear_method(GGUFTritonLinearMethod(config)):
        return factory()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", *GROUP_FORMATS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_method_keeps_blocks_and_multiplies_them(fmt: str, dtype: torch.dtype, monkeypatch):
    """Loaded as a checkpoint hands them over, kept in blocks (the float weight dropped),
    multiplied in registers at every row count: the weight is never de-quantized whole
    (a prefill chunk of 65 or 200 rows included)."""

    def whole_weight(*args: Any) -> None:
        raise AssertionError("the whole weight was de-quantized for a product")

    monkeypatch.setattr(block_kernels, "dequantize", whole_weight)
    k = 256
    layer = build(lambda: RowParallelLinear(k, 48, bias=True, parallel=SINGLE_RANK, dtype=dtype))
    weight = torch.randn(48, k, generator=torch.Generator().manual_seed(5))
    loaded = group_tensor(weight, fmt) if fmt in GROUP_FORMATS else gguf_tensor(weight, fmt)
    bias = torch.randn(48).to(dtype)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], loaded)
    params["bias"].weight_loader(params["bias"], bias)
    # Loaded as blocks, the layer never made its float weight.
    assert layer.weight.untyped_storage().nbytes() == layer.weight.element_size()
    layer.linear_method.process_weights_after_loading(layer)
    ((first, part),) = layer.gguf_blocks
    assert first == 0 and part.bits == (8 if fmt == "Q8_0" else 4)
    assert part.m.numel() == (1 if part.bits == 8 else part.d.numel())  # no offsets for 8 bits
    assert layer.weight.numel() == 0
    reference = block_parts.dequantized_part(block_parts.unpacked(loaded))
    for rows in (1, 5, 65, 200):
        x = torch.randn(2, rows, k).to(dtype)
        got = layer(x)
        assert got.shape == (2, rows, 48)
        want = F.linear(x.double(), reference.to(dtype).double(), bias.double())
        scale = want.abs().max()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.double() - want).abs().max() <= tolerance * scale, rows


def test_a_reload_replaces_blocks_and_floats():
    """Weights loaded again (a wake-up after sleep): blocks over blocks, and float weights
    into a layer that held blocks."""
    layer = build(
        lambda: RowParallelLinear(64, 16, bias=False, parallel=SINGLE_RANK, dtype=torch.float32)
    )
    params = dict(layer.named_parameters())
    x = torch.randn(2, 64)
    for seed in (0, 1):
        loaded = gguf_tensor(
            torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)), "Q8_0"
        )
        params["weight"].weight_loader(params["weight"], loaded)
        layer.linear_method.process_weights_after_loading(layer)
        check_product(layer(x), x, block_parts.dequantized_part(block_parts.unpacked(loaded)))
    dense = torch.randn(16, 64)
    params["weight"].weight_loader(params["weight"], dense)
    layer.linear_method.process_weights_after_loading(layer)
    torch.testing.assert_close(layer(x), F.linear(x, dense))


@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_the_lm_head_stays_in_the_model_dtype(quantization: str):
    from enginecore.layers.embedding import ParallelLMHead, vocab_parallel_logits

    config = SimpleNamespace(model=SimpleNamespace(quantization=quantization))
    head = build(lambda: ParallelLMHead(50, 64, parallel=SINGLE_RANK, dtype=torch.float32), config)
    table = torch.randn(50, 64)
    head.weight.weight_loader(head.weight, table)
    head.linear_method.process_weights_after_loading(head)
    assert getattr(head, "gguf_blocks", None) is None
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(vocab_parallel_logits(hidden, head), F.linear(hidden, table))


def test_int8_per_channel_of_a_float_layer():
    config = SimpleNamespace(model=SimpleNamespace(quantization="int8"))
    layer = build(
        lambda: RowParallelLinear(128, 40, bias=False, parallel=SINGLE_RANK, dtype=torch.bfloat16),
        config,
    )
    weight = torch.randn(40, 128) * torch.linspace(0.1, 3, 40).unsqueeze(1)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], weight.bfloat16())
    layer.linear_method.process_weights_after_loading(layer)
    ((_, part),) = layer.gguf_blocks
    assert part.bits == 8 and layer.weight.numel() == 0
    source = weight.bfloat16().float()
    scale = source.abs().amax(1, keepdim=True) / 127
    reference = torch.round(source / scale).clamp(-127, 127) * scale
    torch.testing.assert_close(gguf_blocks.dequantize(part), reference)
    x = torch.randn(3, 128).bfloat16()
    check_product(layer(x), x, reference)


def test_fused_qkv_with_mixed_formats_runs_once_per_kind():
    layer = build(
        lambda: QKVParallelLinear(
            64, 16, 4, 2, bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    parts = []
    for shard, rows, fmt in (("q", 64, "Q4_1"), ("k", 32, "Q4_1"), ("v", 32, "Q8_0")):
        loaded = gguf_tensor(torch.randn(rows, 64), fmt)
        params["weight"].weight_loader(params["weight"], loaded, shard)
        parts.append(block_parts.dequantized_part(block_parts.unpacked(loaded)))
    layer.linear_method.process_weights_after_loading(layer)
    assert [(first, part.bits) for first, part in layer.gguf_blocks] == [(0, 4), (96, 8)]
    x = torch.randn(2, 64)
    check_product(layer(x), x, torch.cat(parts))


def test_a_shard_in_float_makes_the_layer_float():
    """gate in blocks, up de-quantized at load (Q6_K, say, which this method leaves to the
    loader): the layer computes in the model's dtype."""
    layer = build(
        lambda: MergedColumnParallelLinear(
            64, [32, 32], bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    gate = gguf_tensor(torch.randn(32, 64), "Q4_1")
    up = torch.randn(32, 64)
    params["weight"].weight_loader(params["weight"], gate, 0)
    params["weight"].weight_loader(params["weight"], up, 1)
    layer.linear_method.process_weights_after_loading(layer)
    assert getattr(layer, "gguf_blocks", None) is None
    gate_dq = block_parts.dequantized_part(block_parts.unpacked(gate))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gate_dq, up])))


def test_five_and_six_bit_k_quants_are_left_to_the_loader():
    assert "Q5_K" not in GGUFTritonLinearMethod.gguf_formats
    assert "Q6_K" not in GGUFTritonLinearMethod.gguf_formats
    assert {"Q8_0", "Q4_0", "Q4_1", "Q4_K"} <= set(GGUFTritonLinearMethod.gguf_formats)


class TestGGUFTritonOnFloatWeights(LinearMethodContract):
    """De-quantized (float) tensors take ``F.linear`` unchanged."""

    method = "gguf_triton"
    dtypes = ("float32", "bfloat16")


class TestGGUFTritonOnQ8Blocks(LinearMethodContract):
    """The contract with every loaded weight handed over as Q8_0 blocks (its tolerance:
    the weight's 8-bit rounding)."""

    method = "gguf_triton"
    dtypes = ("float32", "bfloat16")
    tolerance = {"float32": 2e-2, "bfloat16": 3e-2}

    def load(self, layer: Any, tensors: dict[str, Any]) -> None:
        if "weight" in tensors:
            tensor, shard = tensors["weight"]
            tensors = {**tensors, "weight": (gguf_tensor(tensor.float(), "Q8_0"), shard)}
        super().load(layer, tensors)


# --- selection -------------------------------------------------------------------------


def _config(linear_method: str = "auto", quantization: str = "auto") -> Any:
    return SimpleNamespace(
        model=SimpleNamespace(linear_method=linear_method, quantization=quantization)
    )


@pytest.fixture
def gguf_file(tmp_path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")  # the choice reads only the name and that the file exists
    return str(path)


def test_a_gguf_file_on_cuda_selects_gguf_triton(gguf_file):
    refs = registered_refs("linear_method")
    plain = SimpleNamespace()
    name = linear_method_name(_config(), gguf_file, plain, "cuda", torch.bfloat16, refs)
    assert name == "gguf_triton"
    assert select_linear_method("cuda", "bfloat16", refs, name) is GGUFTritonLinearMethod
    # CPU keeps its own method; quantization "none" de-quantizes; a name chosen stays.
    assert linear_method_name(_config(), gguf_file, plain, "cpu", torch.float32, refs) == "gguf"
    none = _config(quantization="none")
    assert linear_method_name(none, gguf_file, plain, "cuda", torch.bfloat16, refs) == "auto"
    named = _config(linear_method="unquantized")
    assert linear_method_name(named, gguf_file, plain, "cuda", torch.bfloat16, refs) == (
        "unquantized"
    )


def test_awq_and_int8_on_cuda_select_gguf_triton(tiny_llama):
    refs = registered_refs("linear_method")
    awq = SimpleNamespace(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 64})
    path = str(tiny_llama)
    assert linear_method_name(_config(), path, awq, "cuda", torch.float16, refs) == "gguf_triton"
    int8 = _config(quantization="int8")
    plain = SimpleNamespace()
    assert linear_method_name(int8, path, plain, "cuda", torch.bfloat16, refs) == "gguf_triton"
    # A float checkpoint on CUDA stays unquantized under auto.
    assert linear_method_name(_config(), path, plain, "cuda", torch.bfloat16, refs) == "auto"
    chosen = select_linear_method("cuda", "bfloat16", refs, "auto")
    assert chosen.name == "unquantized"


def test_int8_without_the_gpu_method_is_refused_naming_it(tiny_llama):
    refs = {k: v for k, v in registered_refs("linear_method").items() if k != "gguf_triton"}
    with pytest.raises(ConfigError, match="none serves cuda"):
        linear_method_name(
            _config(quantization="int8"),
            str(tiny_llama),
            SimpleNamespace(),
            "cuda",
            torch.bfloat16,
            refs,
        )


# --- a whole model ---------------------------------------------------------------------


def _greedy(path: str, **kwargs: Any) -> list[int]:
    from enginecore import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(path, multiprocessing=False, max_model_len=128, **kwargs)
    try:
        out = llm.generate({"prompt_token_ids": list(range(3, 20))}, params)
        return list(out[0].outputs[0].token_ids)
    finally:
        llm.shutdown()


@pytest.fixture
def kept_bits(monkeypatch) -> set[int]:
    """The bit widths of the blocks the layers keep, filled as a model loads."""
    bits: set[int] = set()
    original = GGUFTritonLinearMethod.process_weights_after_loading

    def record(self, layer):
        original(self, layer)
        bits.update(part.bits for _, part in getattr(layer, "gguf_blocks", None) or [])

    monkeypatch.setattr(GGUFTritonLinearMethod, "process_weights_after_loading", record)
    return bits


@pytest.mark.slow
def test_a_q4_gguf_decodes_as_dequantized(tiny_llama, tmp_path, kept_bits):
    """A GGUF file of Q4_0 / Q8_0 / Q4_K projections through the method (its kernels on the
    interpreter) decodes greedily as the same file de-quantized at load."""
    from tests.helpers.gguf_writer import write_gguf

    def mix(name: str) -> str:
        return "Q8_0" if "attn_v" in name else "Q4_K" if "ffn_down" in name else "Q4_0"

    path = str(write_gguf(tiny_llama, tmp_path / "mixed.gguf", types=mix))
    got = _greedy(path, linear_method="gguf_triton")
    assert kept_bits == {4, 8}
    assert got == _greedy(path, quantization="none")


@pytest.mark.slow
def test_int8_of_a_float_checkpoint_decodes_as_the_float_model(tiny_llama, kept_bits):
    from tests.helpers.hf_reference import greedy_reference

    want, first_tie = greedy_reference(tiny_llama, list(range(3, 20)), 6)
    got = _greedy(str(tiny_llama), quantization="int8", linear_method="gguf_triton")
    assert kept_bits == {8}
    agree = min(first_tie + 1, 3)
    assert got[:agree] == want[:agree]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_group_quantized_checkpoint_decodes_as_its_dequantized_weights(
    tiny_llama, tmp_path, kept_bits, method
):
    """AWQ / GPTQ 4-bit groups through the method decode greedily as the float32 checkpoint
    of the weights they stand for."""
    from enginecore.testing.quantizers import write_group_quantized

    quantized, reference = tmp_path / method, tmp_path / f"{method}-dequantized"
    write_group_quantized(tiny_llama, quantized, reference, method, 64, symmetric=False)
    got = _greedy(str(quantized), linear_method="gguf_triton")
    assert kept_bits == {4}
    assert got == _greedy(str(reference))
