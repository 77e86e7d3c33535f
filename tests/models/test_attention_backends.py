"""The attention backends and linear methods against their contracts.

Every built-in backend runs the same matrix (fresh prompts, decodes, chunked prefill,
prefix-cache hits, speculative verification, mixed batches, GQA, sliding windows,
soft-capping, consecutive steps) against float64 attention, so they agree with each
other through the oracle. The ``cpu`` backend runs twice: with its C kernels and with
them switched off (the path a machine without a C compiler takes).
"""

from __future__ import annotations

import pytest

from enginecore.testing import AttentionBackendContract, LinearMethodContract


class TestTorchBackend(AttentionBackendContract):
    backend = "torch"
    dtypes = ("float32", "bfloat16")


class TestCpuBackend(AttentionBackendContract):
    backend = "cpu"
    dtypes = ("float32", "bfloat16")


class TestCpuBackendWithoutKernels(AttentionBackendContract):
    backend = "cpu"

    @pytest.fixture(autouse=True)
    def _kernels_off(self, monkeypatch):
        from enginecore_cpu import cpu_kernels

        monkeypatch.setattr(cpu_kernels.library, "loaded", None)
        monkeypatch.setattr(cpu_kernels.library, "failed", True)
        assert cpu_kernels.load() is None


class TestUnquantizedLinearMethod(LinearMethodContract):
    method = "unquantized"
    dtypes = ("float32", "bfloat16")


class TestCpuPackedLinearMethod(LinearMethodContract):
    method = "cpu_packed"
    dtypes = ("float32", "bfloat16")
