"""The built-in torch model runner passes the conformance kit's ModelRunnerContract."""

from __future__ import annotations

from enginecore.testing import ModelRunnerContract


class TestTorchRunnerOnLlama(ModelRunnerContract):
    runner = "torch"
    base_arch = "llama"


class TestTorchRunnerOnQwen2(ModelRunnerContract):
    runner = "torch"
    base_arch = "qwen2"
