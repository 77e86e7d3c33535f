"""The LoRA kernels: the Triton shrink/expand (run by Triton's interpreter on the CPU)
equal the torch reference, and the reference equals the per-token formula, for a batch
that mixes several adapters, tokens without one, and fused projections' stacked slices."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels' module defines its kernel

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from enginecore.lora.mapping import build_mapping
from enginecore.lora.torch_kernels import TorchLoRAKernels
from enginecore_attention import triton_lora

triton_lora = importlib.reload(triton_lora)  # imported earlier without the flag

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
    b = torch.randn(SLOTS, OUT, WIDTH, generator=gen).to(dtype)
    y = torch.randn(t, OUT, generator=gen).to(dtype)
    return mapping, x, a, b, y, np.repeat(slots, lens)


def per_token(x, a, b, y, token_slots) -> torch.Tensor:
    out = y.double().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] += (x[t].double() @ a[slot].double().t()) @ b[slot].double().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_and_torch_kernels_equal_the_formula(dtype) -> None:
    mapping, x, a, b, y, token_slots = batch(dtype)
    expected = per_token(x, a, b, y, token_slots)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for kernels in (TorchLoRAKernels(), triton_lora.TritonLoRAKernels()):
        out = y.clone()
        buf = kernels.shrink(x, a, mapping)
        assert buf.dtype == torch.float32 and buf.shape == (x.shape[0], WIDTH)
        assert not buf[torch.from_numpy(token_slots < 0)].any(), kernels.name
        kernels.expand(out, buf, b, mapping)
        rel = (out.double() - expected).abs().max() / expected.abs().max()
        assert rel < tol, (kernels.name, float(rel))
        untouched = torch.from_numpy(token_slots < 0)
        assert torch.equal(out[untouched], y[untouched]), kernels.name


def test_one_adapter_for_every_token_takes_the_dense_path() -> None:
    mapping = build_mapping(np.array([1, 1]), np.array([3, 2]), torch.device("cpu"))
    assert mapping.single_slot == 1
    assert build_mapping(np.array([-1, -1]), np.array([3, 2]), torch.device("cpu")) is None
