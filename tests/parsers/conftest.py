"""Fixtures of the parser tests that serve the echo model: its plugin pip-installed, its checkpoint."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.echo_model import ECHO_PLUGIN


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> dict[str, str]:
    """The echo-model plugin pip-installed into a private target dir (on PYTHONPATH)."""
    tmp = tmp_path_factory.mktemp("echo-plugin")
    source = tmp / "src"
    shutil.copytree(ECHO_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
    command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
    command += ["--target", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"pip install failed:\n{result.stdout}\n{result.stderr}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def echo_checkpoint(tmp_path_factory) -> Path:
    # Loaded from its file, not imported as the installed package: this test process must
    # not see the plugin's entry point (other tests build plugin managers here).
    spec = importlib.util.spec_from_file_location(
        "echo_checkpoint", ECHO_PLUGIN / "src" / "enginecore_echo_model" / "checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_echo_checkpoint(tmp_path_factory.mktemp("echo-model"))
