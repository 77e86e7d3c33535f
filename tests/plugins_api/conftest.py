"""Fixtures the plugin-API tests share."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BROKEN_PLUGIN = Path(__file__).parents[1] / "plugins" / "enginecore-broken-parts"


@pytest.fixture(scope="session")
def broken_env(tmp_path_factory) -> dict[str, str]:
    """The package pip-installed into a private target dir, on the children's PYTHONPATH
    only (this process's plugin managers must not see it)."""
    tmp = tmp_path_factory.mktemp("broken-plugin")
    source = tmp / "src"
    shutil.copytree(BROKEN_PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
    command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
    command += ["--target", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"pip install failed:\n{result.stdout}\n{result.stderr}")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ENGINECORE_") or k == "ENGINECORE_CACHE_DIR"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env
