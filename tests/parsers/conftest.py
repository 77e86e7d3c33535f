"""Fixtures of the parser tests that serve the echo model: its plugin pip-installed, its checkpoint."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.helpers.echo_model import ECHO_PLUGIN
from tests.helpers.plugin_install import install_to_target, with_on_path


@pytest.fixture(scope="session")
def echo_env(tmp_path_factory) -> dict[str, str]:
    """The echo-model plugin pip-installed into a private target dir (on PYTHONPATH), once
    for every module that serves it."""
    target = install_to_target(ECHO_PLUGIN, tmp_path_factory.mktemp("echo-plugin"))
    env = dict(os.environ)
    with_on_path(env, target)
    return env


@pytest.fixture(scope="session")
def echo_checkpoint(tmp_path_factory) -> Path:
    # Loaded from its file, not imported as the installed package: this test process must
    # not see the plugin's entry point (other tests build plugin managers here).
    spec = importlib.util.spec_from_file_location(
        "echo_checkpoint", ECHO_PLUGIN / "src" / "enginecore_echo_model" / "checkpoint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_echo_checkpoint(tmp_path_factory.mktemp("echo-model"))
