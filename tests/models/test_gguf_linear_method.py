"""The ``gguf`` linear method: GGUF Q8_0/Q4_0/Q4_1 projections kept in their blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from enginecore.block_formats import gguf_blocks
from enginecore.distributed import SINGLE_RANK
from enginecore.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    use_linear_method,
)
from enginecore.layers.quantized import QuantizedTensor
from enginecore.testing import LinearMethodContract
from enginecore_cpu import quant_gemm, quant_kernels
from enginecore_cpu.gguf_linear_method import DIRECT_MAX_ROWS

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.skipif(quant_kernels.load() is None, reason="no C compiler")


def gguf_tensor(weight: torch.Tensor, fmt: str) -> tuple[QuantizedTensor, torch.Tensor]:
    """``weight`` quantized by gguf's own reference code, and what the blocks stand for."""
    qtype = GGMLQuantizationType[fmt]
    raw = gguf_quants.quantize(weight.float().numpy(), qtype)
    dequantized = torch.from_numpy(np.array(gguf_quants.dequantize(raw, qtype), np.float32))
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(weight.shape[0], -1)
    return QuantizedTensor(data, fmt, tuple(weight.shape)), dequantized.reshape(weight.shape)


def build(factory: Any) -> Any:
    from enginecore_cpu.gguf_linear_method import GGUFLinearMethod

    with use_linear_method(GGUFLinearMethod(None)):
        return factory()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


class TestGGUFOnFloatWeights(LinearMethodContract):
    """De-quantized (float) tensors take the ``cpu_packed`` path unchanged."""

    method = "gguf"


class TestGGUFOnQ8Blocks(LinearMethodContract):
    """The contract with every loaded weight handed over as Q8_0 blocks (its tolerance:
    the weight's and the activations' 8-bit rounding)."""

    method = "gguf"
    tolerance = {"float32": 2e-2}

    def load(self, layer: Any, tensors: dict[str, Any]) -> None:
        if "weight" in tensors:
            tensor, shard = tensors["weight"]
            tensors = {**tensors, "weight": (gguf_tensor(tensor, "Q8_0")[0], shard)}
        super().load(layer, tensors)


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 12, DIRECT_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("gemm", [True, False])
def test_blocks_match_the_dequantized_weight(fmt: str, rows: int, gemm: bool, monkeypatch):
    """Against F.linear on the weight the blocks stand for (gguf's own de-quantization):
    only the activations' 8-bit rounding differs, on the one-row kernels and on the
    many-row ``quant_gemm``; without ``quant_gemm``, prefill sizes take tiles de-quantized
    per call (exact). No float copy of the weight is kept."""
    if not gemm:
        monkeypatch.setattr(quant_gemm.library, "serving", lambda: None)
    torch.manual_seed(0)
    layer = build(
        lambda: RowParallelLinear(256, 96, bias=True, parallel=SINGLE_RANK, dtype=torch.float32)
    )
    loaded, dequantized = gguf_tensor(torch.randn(96, 256), fmt)
    bias = torch.randn(96)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], loaded)
    params["bias"].weight_loader(params["bias"], bias)
    layer.linear_method.process_weights_after_loading(layer)
    assert layer.gguf_blocks and layer.weight.numel() == 0  # the blocks alone
    x = torch.randn(rows, 256)
    want = F.linear(x, dequantized, bias)
    err = relative_error(layer(x), want)
    assert err < (1e-5 if rows > DIRECT_MAX_ROWS and not gemm else 1e-2), err


def test_fused_qkv_with_mixed_formats():
    """Q, K and V in different block formats, loaded shard by shard, as one layer."""
    torch.manual_seed(1)
    layer = build(
        lambda: QKVParallelLinear(
            64, 16, 4, 2, bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    parts = []
    for shard, rows, fmt in (("q", 64, "Q4_1"), ("k", 32, "Q4_1"), ("v", 32, "Q8_0")):
        loaded, dequantized = gguf_tensor(torch.randn(rows, 64), fmt)
        params["weight"].weight_loader(params["weight"], loaded, shard)
        parts.append(dequantized)
    layer.linear_method.process_weights_after_loading(layer)
    assert [part.bits for _, part in layer.gguf_blocks] == [4, 8]  # q and k joined
    x = torch.randn(2, 64)
    assert relative_error(layer(x), F.linear(x, torch.cat(parts))) < 1e-2


def test_a_shard_in_float_makes_the_layer_float():
    """gate in blocks, up de-quantized (a K-quant, say): the layer computes in float."""
    torch.manual_seed(2)
    layer = build(
        lambda: MergedColumnParallelLinear(
            64, [32, 32], bias=False, parallel=SINGLE_RANK, dtype=torch.float32
        )
    )
    params = dict(layer.named_parameters())
    gate, gate_dq = gguf_tensor(torch.randn(32, 64), "Q4_1")
    up = torch.randn(32, 64)
    params["weight"].weight_loader(params["weight"], gate, 0)
    params["weight"].weight_loader(params["weight"], up, 1)
    layer.linear_method.process_weights_after_loading(layer)
    assert getattr(layer, "gguf_blocks", None) is None
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([gate_dq, up])))


def test_unpacks_the_file_layout_as_gguf_does():
    for fmt in gguf_blocks.FORMATS:
        loaded, dequantized = gguf_tensor(torch.randn(8, 128), fmt)
        blocks = gguf_blocks.from_gguf(loaded.data, fmt, loaded.shape)
        torch.testing.assert_close(gguf_blocks.dequantize(blocks), dequantized)
        kernels = quant_kernels.load()
        torch.testing.assert_close(
            kernels.dequantize(blocks.bits, blocks.qs, blocks.d, blocks.m), dequantized
        )


def test_unknown_format_is_named():
    with pytest.raises(ValueError, match="Q5_K"):
        gguf_blocks.from_gguf(torch.zeros(1, 176, dtype=torch.uint8), "Q5_K", (1, 256))


@pytest.mark.slow
def test_demo_gguf_in_blocks_answers_as_dequantized(model_refs):
    """The demo GGUF (Q4_1) through the runner's choice of method, end to end: the engine
    keeps the blocks and answers as the de-quantized model does."""
    from enginecore import LLM, SamplingParams
    from enginecore.checkpoints import find_demo_gguf

    path = str(find_demo_gguf())
    params = SamplingParams(max_tokens=8, temperature=0.0)
    answers = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=path, quantization=quantization, max_model_len=256)
        try:
            out = llm.generate(["The capital of France is"], params)
            answers[quantization] = out[0].outputs[0].text
        finally:
            llm.shutdown()
    assert "Paris" in answers["auto"], answers
    assert answers["auto"].split()[:2] == answers["none"].split()[:2], answers
