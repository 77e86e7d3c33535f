"""MKL's packed GEMM for CPU projections (builtin_cpu/enginecore_cpu/packed_gemm.py).

Greedy equality with transformers through the packed projections is covered by the
model suites (test_llm_correctness, test_models_vs_transformers, ...), which load float32
models on CPU and so pack their wide projections. On an AVX2 CPU without AVX-512 the
runner packs for enginecore's own GEMM instead (test_panel_gemm.py); these tests switch
that off to pin MKL.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import packed_gemm
from enginecore_cpu.linear_method import project
from tests.helpers.packed_gemm import LOADED_MODEL, run_python

MKL = packed_gemm.mkl()
needs_mkl = pytest.mark.skipif(MKL is None, reason="torch without MKL: nothing is packed")


@pytest.fixture(autouse=True)
def mkl_backend(monkeypatch):
    monkeypatch.setenv("ENGINECORE_PANEL_GEMM", "0")


def _input_major(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight laid out as the model runner stores it (use_input_major_weights)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    return torch.nn.Parameter(w.t().contiguous().t(), requires_grad=False)


@needs_mkl
def test_packed_projection_gives_the_same_bits_as_linear():
    weight = _input_major(2048, 256)
    bias = torch.randn(2048)
    assert packed_gemm.pack_weights([weight]) == 1
    gen = torch.Generator().manual_seed(1)
    for rows in (2, 3, 16, 64, 255, 300, 512):
        x = torch.randn(rows, 256, generator=gen)
        assert packed_gemm.packed_for(weight, x) is not None
        assert torch.equal(project(x, weight), F.linear(x, weight))
        assert torch.equal(project(x, weight, bias), F.linear(x, weight, bias))
    batched = torch.randn(4, 5, 256, generator=gen)  # leading dims are flattened
    assert torch.equal(project(batched, weight), F.linear(batched, weight))


@needs_mkl
def test_wide_weights_are_packed_in_column_blocks_with_the_same_bits():
    wide = packed_gemm.MAX_BLOCK_COLUMNS * 2 + 904  # two full blocks and a narrower one
    weight = _input_major(wide, 256, seed=3)
    bias = torch.randn(wide)
    assert packed_gemm.pack_weights([weight]) == 1
    packed = packed_gemm.packed_for(weight, torch.randn(2, 256))
    assert [(first, width) for first, width, _ in packed.blocks] == [
        (0, packed_gemm.MAX_BLOCK_COLUMNS),
        (packed_gemm.MAX_BLOCK_COLUMNS, packed_gemm.MAX_BLOCK_COLUMNS),
        (2 * packed_gemm.MAX_BLOCK_COLUMNS, 904),
    ]
    gen = torch.Generator().manual_seed(2)
    for rows in (2, 64, 256):
        x = torch.randn(rows, 256, generator=gen)
        assert torch.equal(project(x, weight), F.linear(x, weight))
        assert torch.equal(project(x, weight, bias), F.linear(x, weight, bias))


@needs_mkl
def test_one_row_and_large_batches_keep_linear():
    weight = _input_major(2048, 256)
    packed_gemm.pack_weights([weight])
    # One row: MKL's matrix-vector path sums in another order than any GEMM.
    assert packed_gemm.packed_for(weight, torch.randn(1, 256)) is None
    assert packed_gemm.packed_for(weight, torch.randn(256)) is None
    many = torch.randn(packed_gemm.MAX_ROWS + 1, 256)
    assert packed_gemm.packed_for(weight, many) is None
    assert torch.equal(project(many, weight), F.linear(many, weight))


@needs_mkl
def test_narrow_row_major_and_non_float32_weights_are_not_packed():
    narrow = _input_major(packed_gemm.MIN_OUT_FEATURES - 1, 256)
    half = torch.nn.Parameter(_input_major(2048, 256).data.bfloat16(), requires_grad=False)
    # Row-major (a head tied to the embedding): packed, MKL gives other bits than F.linear.
    row_major = torch.nn.Parameter(_input_major(2048, 256).data.contiguous(), requires_grad=False)
    assert packed_gemm.pack_weights([narrow, half, row_major]) == 0
    assert packed_gemm.packed_for(narrow, torch.randn(8, 256)) is None
    assert packed_gemm.packed_bytes([narrow, half, row_major]) == 0


@needs_mkl
def test_a_changed_weight_drops_its_stale_packed_copy():
    weight = _input_major(1024, 256)
    packed_gemm.pack_weights([weight])
    x = torch.randn(8, 256)
    with torch.no_grad():
        weight.mul_(2.0)  # in place: same storage, new version
    assert packed_gemm.packed_for(weight, x) is None
    assert torch.equal(project(x, weight), F.linear(x, weight))
    weight.data = _input_major(1024, 256, seed=1).data  # new storage
    assert packed_gemm.packed_for(weight, x) is None
    assert packed_gemm.pack_weights([weight]) == 1  # packing again makes it current
    assert torch.equal(project(x, weight), F.linear(x, weight))


@needs_mkl
def test_a_weight_that_sums_differently_packed_is_left_unpacked(monkeypatch):
    weight = _input_major(1024, 256)
    monkeypatch.setenv("ENGINECORE_PROBE_CACHE", "0")  # probe now, not a recorded verdict
    monkeypatch.setattr(packed_gemm, "_same_bits", lambda packed, w: False)
    assert packed_gemm.pack_weights([weight]) == 0
    assert packed_gemm.packed_for(weight, torch.randn(8, 256)) is None


@needs_mkl
def test_the_model_runner_packs_wide_projections_unless_switched_off(tiny_llama):
    code = LOADED_MODEL.format(path=tiny_llama)
    packed = run_python(code, ENGINECORE_PANEL_GEMM="0").split(",")
    assert "model.layers.0.mlp.gate_up_proj.weight" in packed
    assert "lm_head.weight" in packed
    assert "model.layers.0.mlp.down_proj.weight" not in packed  # 256 outputs: too narrow
    assert run_python(code, ENGINECORE_PANEL_GEMM="0", ENGINECORE_PACKED_GEMM="0") == ""
