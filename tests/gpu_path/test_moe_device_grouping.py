"""The MoE layer's GPU path never makes the host wait for the device: tokens are grouped by
expert on the device in fixed-shape tiles and multiplied by a Triton grouped GEMM (run here
by Triton's interpreter), so a CUDA graph can capture it; the CUDA-graph runner refuses to
capture a layer that still groups on the host, saying why.

The guard is ``enginecore.testing.host_sync.forbid_host_sync``: a TorchFunctionMode that
raises on ``.tolist()``, ``.item()``, ``.cpu()``, value-shaped ops (``bincount``,
``nonzero``, boolean indexing...), which CUDA's sync debug mode would catch on a GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import SimpleNamespace

# The interpreter is chosen when a @triton.jit function is defined: before the import.
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from enginecore.distributed import ParallelContext
from enginecore.layers import moe_grouped, moe_kernels
from enginecore.layers.moe import FusedMoE, default_grouping, route
from enginecore.testing.host_sync import HostSyncError, forbid_host_sync
from enginecore_models.cuda_graphs import capture_blockers, graphs_apply

if not moe_kernels.is_interpreted():  # imported earlier in this process without the flag
    moe_kernels = importlib.reload(moe_kernels)

E, TOP_K, H, INTER = 8, 2, 48, 40


def _layer(dtype: torch.dtype, grouping: str, seed: int = 0) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(
        E,
        TOP_K,
        H,
        INTER,
        renormalize=True,
        hidden_act="silu",
        parallel=ParallelContext(),
        dtype=dtype,
    )
    layer.w13_weight.data.copy_(torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5)
    layer.w2_weight.data.copy_(torch.randn(E, H, INTER, generator=gen) / INTER**0.5)
    layer.grouping = grouping
    return layer


def _dense_reference(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Every expert over every token in float64, each token keeping its top-k's share."""
    weights, ids = route(logits, TOP_K, True)
    w13, w2 = layer.w13_weight.double(), layer.w2_weight.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(E):
        gate, up = F.linear(x.double(), w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        share = (weights.double() * (ids == e)).sum(-1, keepdim=True)
        out += share * y
    return out


def test_the_guard_catches_the_host_loop():
    """The guard is real: the CPU's loop (counts read on the host) trips it."""
    layer = _layer(torch.float32, "loop")
    x = torch.randn(6, H)
    with forbid_host_sync(), pytest.raises(HostSyncError, match="bincount"):
        layer(x, torch.randn(6, E))
    with forbid_host_sync():
        for sync in (lambda t: t.item(), lambda t: t.bincount(), lambda t: t[t > 0]):
            with pytest.raises(HostSyncError):
                sync(torch.arange(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_device_grouping_never_syncs_and_is_right(dtype: torch.dtype, tokens: int):
    """1 token (a decode step), 7 (experts with nothing), 300 (600 pairs: tiles of many
    rows); equal to every expert computed densely, and to the CPU's loop."""
    layer = _layer(dtype, "device")
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, E, generator=gen).to(dtype)
    with forbid_host_sync():
        got = layer(x, logits)
    assert got.shape == x.shape and got.dtype == dtype
    want = _dense_reference(layer, x, logits)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()
    layer.grouping = "loop"
    loop = layer(x, logits)
    assert (got.double() - loop.double()).abs().max() <= tolerance * want.abs().max()


def test_tiles_hold_one_expert_each_and_every_pair_once():
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [7, 3]])
    pairs, tile_experts = moe_grouped.align_by_expert(ids, E, 4)
    n = ids.numel()
    # Room for the worst case: 8 pairs and every expert's tile part-filled.
    assert pairs.numel() == -(-(n + E * 3) // 4) * 4
    assert sorted(p for p in pairs.tolist() if p < n) == list(range(n))
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_experts.tolist()):
        members = [p for p in pairs[tile * 4 : tile * 4 + 4].tolist() if p < n]
        if expert < 0:
            assert not members
        else:
            assert members and all(flat[p] == expert for p in members)
    # Experts 0, 3, 5, 7 have work: 3's four pairs fill one tile exactly.
    assert [e for e in tile_experts.tolist() if e >= 0] == [0, 3, 5, 7]


def test_empty_step():
    layer = _layer(torch.float32, "device")
    with forbid_host_sync():
        assert layer(torch.zeros(0, H), torch.zeros(0, E)).shape == (0, H)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_a_moe_model_on_the_device_path_matches_transformers(arch, checkpoint_factory, model_refs):
    """Decodes and prefill chunks of several requests in one forward, every MoE layer on
    the device path: the logits transformers gives each request alone."""
    from tests.helpers.model_logits import ATOL, load_ours, reference_logits, run_mixed_batch

    path = checkpoint_factory(arch)
    model = load_ours(path, model_refs)
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers
    for layer in layers:
        layer.grouping = "device"
    prompts, got = run_mixed_batch(model)
    for prompt, logits in zip(prompts, got, strict=True):
        torch.testing.assert_close(logits, reference_logits(path, prompt), atol=ATOL, rtol=0)


def test_cuda_graphs_capture_moe_only_on_the_device_path(caplog):
    """The loop cannot be captured: the runner runs such a model eager and logs why."""
    assert default_grouping(torch.device("cpu")) == "loop"
    model = torch.nn.ModuleList([_layer(torch.float32, "device")])
    assert capture_blockers(model) == []
    model.append(_layer(torch.float32, "loop"))
    model.append(_layer(torch.float32, "loop"))
    (reason,) = capture_blockers(model)
    assert "host" in reason
    runner = SimpleNamespace(
        device=torch.device("cuda"),
        model=model,
        config=SimpleNamespace(model=SimpleNamespace(enforce_eager=False)),
    )
    with caplog.at_level(logging.WARNING, logger="enginecore_models.cuda_graphs"):
        assert graphs_apply(runner) is False
    assert "CUDA graphs are off" in caplog.text and reason in caplog.text


COMPILE_FOR_GPUS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from enginecore.layers import moe_kernels as mg

for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
    for act, block_m, in_fp32, precision in (("bf16", 16, False, "tf32"),
                                             ("fp16", 64, False, "tf32"),
                                             ("fp32", 16, True, "ieee")):
        constexprs = dict(ROW_DIV=2, BLOCK_M=block_m, BLOCK_N=mg._BLOCK_N, BLOCK_K=mg._BLOCK_K,
                          DOT_IN_FP32=in_fp32, DOT_PRECISION=precision)
        pointers = {"a_ptr": "*" + act, "w_ptr": "*" + act, "out_ptr": "*" + act,
                    "pairs_ptr": "*i64", "tile_experts_ptr": "*i64"}
        signature = {
            name: "constexpr" if name in constexprs else pointers.get(name, "i32")
            for name in mg._grouped_linear_kernel.arg_names
        }
        triton.compile(ASTSource(mg._grouped_linear_kernel, signature, constexprs), target=target)
    print("compiled for", target.backend)
"""


@pytest.mark.slow
def test_the_kernel_compiles_for_nvidia_and_amd_gpus():
    """The interpreter accepts code a GPU compiler rejects (the early return of an idle tile
    among it): compile for sm_90 and gfx942 with the compilers in the triton wheel."""
    import subprocess
    import sys

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
