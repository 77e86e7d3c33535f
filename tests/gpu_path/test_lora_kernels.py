"""The LoRA kernels: the Triton shrink/expand (run by Triton's interpreter on the CPU),
the torch reference and the dense kernels CUDA graphs replay equal the per-token
formula, for a batch that mixes several adapters, tokens without one, and fused
projections' stacked slices.

The Triton half runs in a fresh process with ``TRITON_INTERPRET=1``: the interpreter is
chosen when ``triton.language`` is imported, which another test module may have done.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from enginecore.lora.dense_kernels import DenseLoRAKernels
from enginecore.lora.mapping import build_mapping
from enginecore.lora.torch_kernels import TorchLoRAKernels

SLOTS, WIDTH, IN, OUT = 3, 24, 40, 70  # WIDTH: three slices of rank 8


def batch(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    # Requests: slot 2 (prefill of 5), none (3), slot 0 (decode), slot 2 (decode),
    # slot 1 (4), none (decode).
    slots = np.array([2, -1, 0, 2, 1, -1])
    lens = np.array([5, 3, 1, 1, 4, 1])
    mapping = build_mapping(slots, lens, torch.device("cpu"))
    t = int(lens.sum())
    x = torch.randn(t, IN, generator=gen).to(dtype)
    a = torch.randn(SLOTS, WIDTH, IN, generator=gen).to(dtype)
    # Slot-minor, as LoRALayer keeps B: [SLOTS, OUT, WIDTH] seen through a permute.
    b = torch.randn(OUT, SLOTS, WIDTH, generator=gen).to(dtype).permute(1, 0, 2)
    y = torch.randn(t, OUT, generator=gen).to(dtype)
    return mapping, x, a, b, y, np.repeat(slots, lens)


def per_token(x, a, b, y, token_slots) -> torch.Tensor:
    out = y.double().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] += (x[t].double() @ a[slot].double().t()) @ b[slot].double().t()
    return out


def check_kernels(kernels, dtype: torch.dtype) -> None:
    mapping, x, a, b, y, token_slots = batch(dtype)
    expected = per_token(x, a, b, y, token_slots)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    out = y.clone()
    buf = kernels.shrink(x, a, mapping)
    assert buf.dtype == torch.float32 and buf.shape == (x.shape[0], WIDTH)
    untouched = torch.from_numpy(token_slots < 0)
    assert not buf[untouched].any(), kernels.name
    kernels.expand(out, buf, b, mapping)
    rel = (out.double() - expected).abs().max() / expected.abs().max()
    assert rel < tol, (kernels.name, float(rel))
    assert torch.equal(out[untouched], y[untouched]), kernels.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernels_equal_the_formula(dtype) -> None:
    check_kernels(TorchLoRAKernels(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_kernels_equal_the_formula(dtype) -> None:
    """The kernels CUDA graphs replay (every slot computed, masked per token)."""
    check_kernels(DenseLoRAKernels(), dtype)


def test_triton_kernels_equal_the_formula_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")
    here = pathlib.Path(__file__).parent
    code = (
        "import torch, test_lora_kernels as t\n"
        "from enginecore_attention.triton_lora import TritonLoRAKernels\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    t.check_kernels(TritonLoRAKernels(), dtype)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_one_adapter_for_every_token_takes_the_dense_path() -> None:
    mapping = build_mapping(np.array([1, 1]), np.array([3, 2]), torch.device("cpu"))
    assert mapping.single_slot == 1
    assert build_mapping(np.array([-1, -1]), np.array([3, 2]), torch.device("cpu")) is None
