"""The built-in torch model runner passes the conformance kit's ModelRunnerContract.

(The other architectures are checked against transformers in test_model_runner.py; the
model starter's slow test runs the contract with a relabelled architecture.)"""

from __future__ import annotations

from enginecore.testing import ModelRunnerContract


class TestTorchRunnerOnLlama(ModelRunnerContract):
    runner = "torch"
    base_arch = "llama"
