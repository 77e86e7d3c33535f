"""The conformance kit's engine fixture ``enginecore_engine_process`` as a plugin author's
tests use it, with ``enginecore_config_overrides`` selecting components.
(``enginecore_server`` is exercised by test_cli_rpc.py; ``enginecore_llm`` by the
executor starter's test in test_plugin_starter.py.)"""

from __future__ import annotations

import os

import pytest

from enginecore import SamplingParams


@pytest.fixture(scope="module")
def enginecore_config_overrides():
    return {"scheduling_policy": "priority", "max_num_seqs": 4}


def test_engine_process_runs_elsewhere_with_the_overrides(enginecore_engine_process):
    llm = enginecore_engine_process
    components = llm.engine_client.ready.components
    assert components["scheduling_policy"] == "priority (from builtin_schedulers)"
    [pid] = llm.collective_rpc("get_pid")
    assert pid != os.getpid()  # the engine core (and its worker) live in another process
    out = llm.generate(
        {"prompt_token_ids": [11, 12, 13, 14]},
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 5
