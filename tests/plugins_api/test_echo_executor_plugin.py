"""The third-party executor plugin in ``plugins/enginecore-echo-executor``, pip-installed.

It is selected the way a user selects it (a config file naming ``executor = "echo"``),
runs a real engine process, and passes the conformance kit's ExecutorContract (its own
test suite, run as shipped).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore import LLM, SamplingParams, make_config
from enginecore.engine.components import resolve_components
from enginecore.plugins import make_plugin_manager
from tests.helpers.editable_installs import add_editable_paths, is_current

REPO = Path(__file__).resolve().parents[2]
ECHO = REPO / "plugins" / "enginecore-echo-executor"
DIST = "enginecore-echo-executor"


@pytest.fixture(scope="module")
def echo_installed() -> Path:
    with open(Path(sys.prefix) / ".enginecore-test-plugins.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(DIST, ECHO):
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
            command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
            result = subprocess.run(
                [*command, "-e", str(ECHO)], capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, result.stdout + result.stderr
        assert is_current(DIST, ECHO)
        add_editable_paths(DIST)
    return ECHO


def test_a_config_file_selects_the_echo_executor(echo_installed, tmp_path) -> None:
    from enginecore_echo_executor import EchoExecutor

    config_file = tmp_path / "engine.toml"
    config_file.write_text('[parallel]\nexecutor = "echo"\n')
    components = resolve_components(make_config(config_file), make_plugin_manager())
    assert components.executor_cls is EchoExecutor
    assert components.providers["executor"] == "echo (from echo_executor)"


def test_an_engine_runs_on_the_echo_executor(echo_installed, tiny_llama, tmp_path):
    from enginecore_echo_executor import EchoExecutor

    config_file = tmp_path / "engine.toml"
    config_file.write_text(
        f'[model]\npath = "{tiny_llama}"\ndtype = "float32"\n'
        '[parallel]\nexecutor = "echo"\n[cache]\nnum_blocks_override = 64\n'
        "[engine]\nmultiprocessing = false\n"
    )
    with LLM(config=make_config(config_file)) as llm:
        assert llm.engine_client.ready.components["executor"] == "echo (from echo_executor)"
        out = llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        executor = llm.engine_client.engine.executor
        assert isinstance(executor, EchoExecutor) and executor.inner_name == "uni"
        methods = [r.method for r in executor.records]
    assert "execute_model" in methods and "sample_tokens" in methods
    assert "determine_available_memory" not in methods  # num_blocks_override skips profiling


@pytest.mark.slow
def test_the_echo_plugin_passes_its_own_suite(echo_installed) -> None:
    """Its suite subclasses ExecutorContract over uni and over mp."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=echo_installed,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout
