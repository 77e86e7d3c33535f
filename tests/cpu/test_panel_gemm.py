"""enginecore's own AVX2 GEMM for CPU projections (builtin_cpu/enginecore_cpu/panel_gemm.py, ec_gemm).

The kernel tests run wherever it is built (AVX2 and FMA), whether or not this CPU prefers
it; the model runner's choice is tested on the CPUs that prefer it. Greedy equality with
transformers through it is covered by the model suites, which pack on such a CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from enginecore_cpu import cpu_kernels, packed_gemm, panel_gemm
from enginecore_cpu.linear_method import project, project_silu_and_mul
from tests.helpers.packed_gemm import LOADED_MODEL, run_python

KERNELS = cpu_kernels.load()
needs_gemm = pytest.mark.skipif(
    KERNELS is None or not KERNELS.gemm_available(), reason="ec_gemm needs AVX2 and FMA"
)


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    wide = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), wide).float()


@needs_gemm
@pytest.mark.parametrize(
    "out_features,in_features",
    # Tails: 100 = 6 x 16 + 4 columns. 520 columns (33 panels) copy each row block into
    # tiles first, and 77 = 9 x 8 + 5 leaves a tail past the copy's 8-wide transposes.
    [(2048, 256), (256, 1024), (100, 77), (520, 77), (16, 1), (5, 300)],
)
def test_products_match_a_float64_reference(out_features, in_features):
    weight = _weight(out_features, in_features)
    packed = panel_gemm.PanelWeight(KERNELS, weight)
    bias = torch.randn(out_features)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 5, 6, 7, 13, 64, 301):  # every tile height, several row blocks
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            got = packed.linear(x, b)
            assert got.shape == (rows, out_features)
            torch.testing.assert_close(got, _reference(x, weight, b), atol=1e-5, rtol=1e-5)


@needs_gemm
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    # 512 columns: up to 18 rows are read in place, from 19 (4 tiles) copied into tiles first.
    weight = _weight(512, 256)
    packed = panel_gemm.PanelWeight(KERNELS, weight)
    bias = torch.randn(512)
    x = torch.randn(700, 256)  # 700 rows: several row blocks, split over the threads
    whole = packed.linear(x, bias)
    for rows in (1, 2, 3, 4, 5, 6, 7, 37, 256):
        assert torch.equal(packed.linear(x[:rows], bias), whole[:rows])
    for row in (0, 5, 6, 350, 699):
        assert torch.equal(packed.linear(x[row : row + 1], bias), whole[row : row + 1])


@needs_gemm
def test_either_weight_layout_and_strided_rows_give_the_same_bits():
    for columns in (300, 600):  # rows read in place, and copied into tiles first
        weight = _weight(columns, 256)
        row_major = panel_gemm.PanelWeight(KERNELS, weight)
        input_major = panel_gemm.PanelWeight(KERNELS, weight.t().contiguous().t())
        wider = torch.randn(4, 9, 512)
        x = wider[..., :256]  # rows 512 floats apart, leading dims flattened
        got = input_major.linear(x)
        assert got.shape == (4, 9, columns)
        assert torch.equal(got, row_major.linear(x.contiguous()))
        assert torch.equal(got.reshape(36, columns), row_major.linear(x.reshape(36, 256)))


@needs_gemm
@pytest.mark.parametrize("intermediate,in_features", [(1024, 256), (24, 77), (8, 3), (264, 40)])
def test_a_gated_pack_gives_the_plain_bits_and_silu_and_mul_of_them(intermediate, in_features):
    # 264 = 33 pairs: wide enough to copy its rows into tiles first; 77 and 3 leave k tails.
    weight = _weight(2 * intermediate, in_features)
    plain = panel_gemm.PanelWeight(KERNELS, weight)
    gated = panel_gemm.PanelWeight(KERNELS, weight, intermediate)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(2 * intermediate, generator=gen)
    for rows in (1, 5, 6, 7, 37, 301):  # every tile height, several row blocks
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            product = plain.linear(x, b)
            assert torch.equal(gated.linear(x, b), product)  # the plain column order
            fused = gated.silu_and_mul(x, b)
            assert fused.shape == (rows, intermediate)
            assert torch.equal(fused, KERNELS.silu_and_mul(product))


@needs_gemm
def test_a_gated_pack_needs_halves_of_a_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 8"):
        panel_gemm.PanelWeight(KERNELS, _weight(24, 16), 12)
    with pytest.raises(ValueError, match=r"\[gate; up\]"):
        panel_gemm.PanelWeight(KERNELS, _weight(32, 16)).silu_and_mul(torch.randn(2, 16))
    assert panel_gemm.gated_half(_weight(32, 16)) == 0  # not marked by an MLP
    for rows, half, expected in ((32, 16, 16), (24, 12, 0), (32, 8, 0)):
        weight = _weight(rows, 16)
        setattr(weight, panel_gemm.GATED_HALF, half)
        assert panel_gemm.gated_half(weight) == expected


@needs_gemm
def test_a_marked_mlp_weight_is_packed_in_pairs_and_fused(monkeypatch):
    monkeypatch.setattr(panel_gemm, "preferred", lambda: True)
    gate_up = _weight(2048, 256).t().contiguous().t()
    setattr(gate_up, panel_gemm.GATED_HALF, 1024)
    plain = _weight(2048, 256)
    packed_gemm.pack_weights([gate_up, plain])
    x = torch.randn(9, 256)
    assert packed_gemm.packed_for(gate_up, x).half == 1024
    assert packed_gemm.packed_for(plain, x).half == 0
    fused = project_silu_and_mul(x, gate_up)
    gate, up = project(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(fused, F.silu(gate) * up)
    assert project_silu_and_mul(x, plain) is None  # not a [gate; up] packing
    assert project_silu_and_mul(x.bfloat16(), gate_up) is None  # rounds in between
    gate_up.mul_(2.0)  # stale panels: the caller projects, then applies SiLU
    assert project_silu_and_mul(x, gate_up) is None


@needs_gemm
def test_other_activation_dtypes_are_refused():
    packed = panel_gemm.PanelWeight(KERNELS, _weight(32, 16))
    with pytest.raises(TypeError, match="bfloat16"):
        packed.linear(torch.randn(4, 16).bfloat16())


@needs_gemm
def test_pack_weights_takes_every_float32_matrix_when_preferred(monkeypatch):
    monkeypatch.setattr(panel_gemm, "preferred", lambda: True)
    narrow = _weight(256, 1024)  # any width and either layout
    wide = _weight(2048, 256).t().contiguous().t()
    half = _weight(2048, 256).bfloat16()
    assert packed_gemm.backend() == "enginecore's AVX2 GEMM"
    assert packed_gemm.pack_weights([narrow, wide, half]) == 2
    assert packed_gemm.packed_bytes([narrow, wide, half]) == (256 * 1024 + 2048 * 256) * 4
    one_row = torch.randn(1, 1024)  # a single row too: the same chain as in any batch
    assert isinstance(packed_gemm.packed_for(narrow, one_row), panel_gemm.PanelWeight)
    assert packed_gemm.packed_for(half, torch.randn(2, 256)) is None
    torch.testing.assert_close(project(one_row, narrow), _reference(one_row, narrow, None))


@needs_gemm
def test_a_changed_weight_drops_its_stale_panels(monkeypatch):
    monkeypatch.setattr(panel_gemm, "preferred", lambda: True)
    weight = _weight(512, 256)
    packed_gemm.pack_weights([weight])
    x = torch.randn(8, 256)
    assert packed_gemm.packed_for(weight, x) is not None
    weight.mul_(2.0)  # in place: same storage, new version
    assert packed_gemm.packed_for(weight, x) is None
    assert torch.equal(project(x, weight), F.linear(x, weight))


def test_only_an_avx2_cpu_without_avx512_prefers_it(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not panel_gemm.preferred()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv(panel_gemm.ENV_SWITCH, "0")
    assert not panel_gemm.preferred()
    monkeypatch.delenv(panel_gemm.ENV_SWITCH)
    assert panel_gemm.preferred() == (KERNELS is not None and KERNELS.gemm_available())


@pytest.mark.skipif(not panel_gemm.preferred(), reason="this CPU keeps MKL's GEMM")
def test_the_model_runner_packs_every_projection_for_it(tiny_llama):
    code = LOADED_MODEL.format(path=tiny_llama)
    packed = run_python(code).split(",")
    assert "model.layers.0.mlp.gate_up_proj.weight (gated)" in packed  # SiLU as it stores
    for name in ("down_proj", "qkv_proj", "o_proj"):
        assert f"model.layers.0.mlp.{name}.weight" in packed or (
            f"model.layers.0.self_attn.{name}.weight" in packed
        )
    assert "lm_head.weight" in packed
    # Switched off, MKL packs the wide ones only.
    assert "model.layers.0.mlp.down_proj.weight" not in run_python(code, ENGINECORE_PANEL_GEMM="0")
