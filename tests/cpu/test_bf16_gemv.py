"""bfloat16 weights on a CPU with AVX512-BF16: enginecore's few-row kernel (``bf16_gemv``)
against a float64 reference, the ``cpu_packed`` method's choice between it and torch's
bfloat16 ``F.linear``, and a whole bfloat16 model with the kernel on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore import LLM, SamplingParams
from enginecore.distributed import SINGLE_RANK
from enginecore.layers.linear import ColumnParallelLinear, use_linear_method
from enginecore_cpu import bf16_gemv, cpu_kernels
from enginecore_cpu.linear_method import CpuPackedLinearMethod, project
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

needs_bf16 = pytest.mark.skipif(
    not bf16_gemv.cpu_has_avx512_bf16() or bf16_gemv.load() is None,
    reason="needs a CPU with avx512_bf16 and a C compiler",
)


def _bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).bfloat16()


def _assert_close_to_exact(out: torch.Tensor, x, weight, bias) -> None:
    """Float32 sums of exact products, rounded to bfloat16 once: within half a bfloat16
    step of the sum plus the float32 rounding of K additions."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    k = weight.shape[1]
    bound = 2.0**-8 * exact.abs() + 1.01 * (k + 2) * 2.0**-24 * magnitude
    err = (out.double() - exact).abs()
    assert out.dtype == torch.bfloat16
    assert (err <= bound).all(), f"largest excess {(err - bound).max().item()}"


@needs_bf16
@pytest.mark.parametrize("k", [1, 31, 32, 33, 95, 576])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 9])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_reference_at_every_tail(k: int, n: int, with_bias: bool):
    """K not a multiple of 32, N not a multiple of the 4-row tile, 1 to 17 rows (the
    4-row activation passes and each remainder)."""
    gen = torch.Generator().manual_seed(k * 100 + n)
    kernel = bf16_gemv.load()
    weight = _bf16(n, k, gen=gen)
    bias = _bf16(n, gen=gen) if with_bias else None
    for rows in range(1, 18):
        x = _bf16(rows, k, gen=gen)
        _assert_close_to_exact(kernel.linear(x, weight, bias), x, weight, bias)


@needs_bf16
def test_kernel_reads_strided_activations_and_weights():
    """A row stride wider than K (a slice of a fused projection's output, a view of a
    larger weight) reads the right values."""
    gen = torch.Generator().manual_seed(3)
    kernel = bf16_gemv.load()
    wide_x, wide_w = _bf16(5, 80, gen=gen), _bf16(11, 70, gen=gen)
    x, weight = wide_x[:, 3:67], wide_w[:, 2:66]
    _assert_close_to_exact(kernel.linear(x, weight), x, weight, None)
    assert kernel.linear(x, weight).shape == (5, 11)


@needs_bf16
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(4)
    kernel = bf16_gemv.load()
    weight, bias = _bf16(37, 200, gen=gen), _bf16(37, gen=gen)
    x = _bf16(17, 200, gen=gen)
    batch = kernel.linear(x, weight, bias)
    for row in range(17):
        assert torch.equal(kernel.linear(x[row : row + 1], weight, bias)[0], batch[row])
    for start, stop in ((0, 3), (2, 7), (5, 17), (9, 11)):
        assert torch.equal(kernel.linear(x[start:stop], weight, bias), batch[start:stop])


@needs_bf16
def test_kernel_refuses_what_it_cannot_read():
    kernel = bf16_gemv.load()
    weight = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K contiguous"):
        kernel.linear(torch.zeros(2, 64, dtype=torch.bfloat16), weight.t().contiguous().t())
    with pytest.raises(ValueError, match="activations"):
        kernel.linear(torch.zeros(2, 64), weight)


class _Calls:
    """Counts the kernel's calls, passing them through to the real kernel."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = bf16_gemv.Bf16Gemv.linear

        def counted(kernel, *args, **kwargs):
            self.count += 1
            return real(kernel, *args, **kwargs)

        monkeypatch.setattr(bf16_gemv.Bf16Gemv, "linear", counted)


def _bf16_layer() -> ColumnParallelLinear:
    with use_linear_method(CpuPackedLinearMethod(None)):
        layer = ColumnParallelLinear(192, 80, bias=True, parallel=SINGLE_RANK, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    params = dict(layer.named_parameters())
    params["weight"].weight_loader(params["weight"], _bf16(80, 192, gen=gen))
    params["bias"].weight_loader(params["bias"], _bf16(80, gen=gen))
    layer.linear_method.process_weights_after_loading(layer)
    return layer


@needs_bf16
def test_method_keeps_bfloat16_and_picks_by_row_count(monkeypatch):
    """Up to ``KERNEL_MAX_ROWS`` rows the kernel, above it torch's bfloat16 F.linear."""
    layer = _bf16_layer()
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.stride() == (192, 1)
    calls = _Calls(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    limit = bf16_gemv.KERNEL_MAX_ROWS
    for rows in (1, limit):
        x = _bf16(rows, 192, gen=gen)
        before = calls.count
        out = layer(x)
        assert calls.count == before + 1, f"{rows} rows did not run the kernel"
        _assert_close_to_exact(out, x, layer.weight, layer.bias)
    before = calls.count
    x = _bf16(limit + 1, 192, gen=gen)
    out = layer(x)
    assert calls.count == before, f"{limit + 1} rows ran the kernel"
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    # a decode step's [tokens, hidden] view of a 3-d batch counts its rows, not its first dim
    x3 = _bf16(2, limit, 192, gen=gen)
    before = calls.count
    assert torch.equal(
        project(x3, layer.weight, layer.bias), F.linear(x3, layer.weight, layer.bias)
    )
    assert calls.count == before


def test_method_without_avx512_bf16_keeps_the_float32_widening(monkeypatch):
    """No AVX512-BF16: a bfloat16 weight is widened to float32 where there is no AMX
    either, else kept in bfloat16 for oneDNN, and the kernel is never loaded."""
    monkeypatch.setattr(bf16_gemv, "cpu_has_avx512_bf16", lambda: False)
    monkeypatch.setattr(bf16_gemv.library, "loaded", None)
    monkeypatch.setattr(bf16_gemv.library, "failed", False)
    layer = _bf16_layer()
    assert bf16_gemv.load() is None
    widened = not cpu_kernels.cpu_has_amx()
    assert layer.weight.dtype == (torch.float32 if widened else torch.bfloat16)
    assert layer.weight.stride() == (1, 80)  # input-major, as before
    x = torch.randn(3, 192).bfloat16()
    _assert_close_to_exact(layer(x), x, layer.weight.bfloat16(), layer.bias)


@pytest.mark.slow
@needs_bf16
def test_bfloat16_model_with_the_kernel_on_and_off(checkpoint_factory, monkeypatch):
    """Greedy output equals transformers' bfloat16 generate (up to its first near tie)
    with every decode step in the kernel and with none; both runs give the same tokens."""
    path = checkpoint_factory("llama")
    prompts = mixed_prompts(3)[:4]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    calls = _Calls(monkeypatch)
    tokens = {}
    for label, limit in (("kernel", 1 << 20), ("oneDNN", 0)):
        monkeypatch.setattr(bf16_gemv, "KERNEL_MAX_ROWS", limit)
        before = calls.count
        with LLM(path, dtype="bfloat16", multiprocessing=False, max_num_batched_tokens=64) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert (calls.count > before) == (limit > 0), label
        tokens[label] = [out.outputs[0].token_ids for out in outs]
        for i, prompt in enumerate(prompts):
            reference = greedy_reference(path, prompt, 10, torch.bfloat16)
            assert_matches_reference(tokens[label][i], reference, f"{label} prompt {i}")
    for i, prompt in enumerate(prompts):
        first_tie = greedy_reference(path, prompt, 10, torch.bfloat16)[1]
        assert tokens["kernel"][i][:first_tie] == tokens["oneDNN"][i][:first_tie]
