"""A second draft proposer from a real, pip-installed plugin package.

``plugins/enginecore-cycle-proposer`` registers ``"cycle"`` through
``register_spec_decode_proposers``; the engine selects it by config, the worker imports
it by the reference the engine resolved, and the output is the same as without
speculation.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.editable_installs import add_editable_paths, is_current
from tests.helpers.spec_decode import mixed_spec_prompts, run_engine

PACKAGE = Path(__file__).resolve().parents[2] / "plugins" / "enginecore-cycle-proposer"
DIST = "enginecore-cycle-proposer"
CYCLE = dict(speculative_method="cycle", num_speculative_tokens=4)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cycle_plugin() -> Path:
    lock_path = Path(sys.prefix) / ".enginecore-test-plugins.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(DIST, PACKAGE):
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
            command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
            result = subprocess.run(
                [*command, "-e", str(PACKAGE)], capture_output=True, text=True, timeout=300
            )
            if result.returncode != 0:
                pytest.fail(f"pip install failed:\n{result.stdout}\n{result.stderr}")
        assert is_current(DIST, PACKAGE)
        add_editable_paths(DIST)
    return PACKAGE


def test_plugins_command_lists_the_proposer(cycle_plugin) -> None:
    enginecore = Path(sys.executable).parent / "enginecore"
    result = subprocess.run(
        [str(enginecore), "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    records = {r["name"]: r for r in json.loads(result.stdout)}
    record = records["cycle_proposer"]
    assert record["distribution"] == DIST and record["error"] is None
    assert record["registered"] == {"spec_decode_proposer": ["cycle"]}
    assert records["builtin_models"]["registered"]["spec_decode_proposer"] == ["ngram"]


def test_the_plugin_proposer_speeds_up_without_changing_output(cycle_plugin, tiny_llama) -> None:
    prompts = mixed_spec_prompts(seed=9)[:8]
    requests = [(p, GREEDY) for p in prompts]
    base = run_engine(tiny_llama, requests)
    spec = run_engine(tiny_llama, requests, **CYCLE)
    assert spec.in_order() == base.in_order()
    # The random model falls into loops, which is where this proposer hits.
    assert spec.spec_num_accepted_tokens > 0
    # The same through a separate engine process, whose worker imports the proposer.
    with LLM(tiny_llama, dtype="float32", num_blocks_override=256, **CYCLE) as llm:
        assert "cycle (from cycle_proposer)" in llm.engine_client.ready.components.values()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == base.in_order()[:2]


@pytest.mark.slow  # its contract suite repeats the engine check above in a subprocess
def test_the_packages_own_tests_pass(cycle_plugin) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=cycle_plugin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout
