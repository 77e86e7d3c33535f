"""The conformance kit's engine fixtures (``enginecore_llm``, ``enginecore_engine_process``)
as a plugin author's tests use them, with ``enginecore_config_overrides`` selecting
components. (``enginecore_server`` is exercised by test_cli_rpc.py.)"""

from __future__ import annotations

import os

import pytest

from enginecore import SamplingParams


@pytest.fixture(scope="module")
def enginecore_config_overrides():
    return {"scheduling_policy": "priority", "max_num_seqs": 4}


def greedy_tokens(llm) -> list[int]:
    out = llm.generate(
        {"prompt_token_ids": [11, 12, 13, 14]},
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    return out[0].outputs[0].token_ids


def test_in_process_engine_uses_the_overrides(enginecore_llm):
    engine = enginecore_llm.engine_client.engine  # in-process: the EngineCore itself
    assert engine.components.providers["scheduling_policy"] == "priority (from builtin_schedulers)"
    assert engine.config.scheduler.max_num_seqs == 4
    assert len(greedy_tokens(enginecore_llm)) == 5


def test_engine_process_runs_elsewhere_and_agrees(enginecore_engine_process, enginecore_llm):
    [pid] = enginecore_engine_process.collective_rpc("get_pid")
    assert pid != os.getpid()  # the engine core (and its worker) live in another process
    assert greedy_tokens(enginecore_engine_process) == greedy_tokens(enginecore_llm)
