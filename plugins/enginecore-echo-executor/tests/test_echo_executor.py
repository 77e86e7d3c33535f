"""Tests of the echo executor. Run with the package installed (``pip install -e .``)."""

from __future__ import annotations

import pytest
from enginecore_echo_executor import EchoExecutor

from enginecore import LLM, SamplingParams
from enginecore.testing import ExecutorContract


class TestEchoOverUni(ExecutorContract):
    """Selected by name, as a config would: the registered entry point must work."""

    executor = "echo"
    world_size = 1


class EchoOverMp(EchoExecutor):
    inner = "mp"


class TestEchoOverMp(ExecutorContract):
    """Wrapping a multi-process executor: the death chain passes through the wrapper."""

    executor = EchoOverMp
    world_size = 2
    config_overrides = {"executor": "mp"}


def test_every_rpc_is_recorded(tmp_path, caplog) -> None:
    from enginecore.checkpoints import make_random_checkpoint

    path = make_random_checkpoint(tmp_path / "tiny", arch="llama", size="tiny")
    caplog.set_level("INFO", logger="enginecore_echo_executor")
    with LLM(
        path, executor="echo", multiprocessing=False, num_blocks_override=64, dtype="float32"
    ) as llm:
        out = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True))
        executor = llm.engine_client.engine.executor
        assert isinstance(executor, EchoExecutor)
        methods = [r.method for r in executor.records]
    assert len(out[0].outputs[0].token_ids) == 4
    # Start-up asks the runner's block size and the model's length before the cache is
    # sized (and, where it profiles, the memory free); then the steps.
    start = methods.index("initialize_cache")
    assert "get_max_model_len" in methods[:start]
    assert methods[start + 1] == "execute_model"
    assert methods.count("execute_model") >= 4 and methods.count("sample_tokens") >= 4
    assert all(r.seconds is not None and r.error is None for r in executor.records)
    assert "rpc #" in caplog.text and "execute_model (non_block)" in caplog.text


def test_wrapping_itself_is_refused() -> None:
    class Loop(EchoExecutor):
        inner = "echo"

    from enginecore.config import make_config
    from enginecore.interfaces import WorkerSpec

    with pytest.raises(ValueError, match="cannot wrap itself"):
        Loop(make_config(model="x"), WorkerSpec(worker_ref="", model_runner_ref="", model_refs={}))
