"""A torch model runner on a test checkpoint and a driver that feeds it hand-built SchedulerOutputs."""

from __future__ import annotations

import torch

from enginecore import make_config
from enginecore.interfaces import WorkerSpec
from enginecore.testing.model_runner_contract import RunnerDriver
from enginecore_models.model_runner import TorchModelRunner


def make_runner(
    path, model_refs, *, block_size=4, num_blocks=256, proposer_ref=None, parallel=None, **overrides
):
    config = make_config(
        model=str(path), dtype="float32", block_size=block_size, max_model_len=512, **overrides
    )
    spec = WorkerSpec(
        worker_ref="enginecore_executors.worker:Worker",
        model_runner_ref="enginecore_models.model_runner:TorchModelRunner",
        model_refs=model_refs,
        spec_decode_proposer_ref=proposer_ref,
    )
    if parallel is None:
        runner = TorchModelRunner(config, spec, torch.device("cpu"))
    else:
        runner = TorchModelRunner(config, spec, torch.device("cpu"), parallel)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def driver_for(runner: TorchModelRunner, budget: int) -> RunnerDriver:
    """The conformance kit's scheduler stand-in over this runner's KV cache."""
    return RunnerDriver(runner, runner.num_blocks, runner.block_size, budget=budget)


PROMPTS = {"a": list(range(3, 8)), "b": list(range(100, 117)), "c": [7, 300, 42] * 10}
