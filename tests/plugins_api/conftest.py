"""Fixtures the plugin-API tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.plugin_install import install_to_target, with_on_path

BROKEN_PLUGIN = Path(__file__).parents[1] / "plugins" / "enginecore-broken-parts"


@pytest.fixture(scope="session")
def broken_env(tmp_path_factory) -> dict[str, str]:
    """The package pip-installed into a private target dir, on the children's PYTHONPATH
    only (this process's plugin managers must not see it)."""
    target = install_to_target(BROKEN_PLUGIN, tmp_path_factory.mktemp("broken-plugin"))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ENGINECORE_") or k == "ENGINECORE_CACHE_DIR"
    }
    with_on_path(env, target)
    return env
