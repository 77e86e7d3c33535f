"""A plugin package pip-installed into a private directory, for child processes only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def install_to_target(package: Path, tmp: Path) -> Path:
    """Copy ``package`` under ``tmp`` and pip-install it into ``tmp/site`` (no deps, no
    build isolation); returns the directory to put on a child's ``PYTHONPATH``."""
    source = tmp / "src"
    shutil.copytree(package, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = tmp / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
    command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
    command += ["--target", str(target), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"pip install failed:\n{result.stdout}\n{result.stderr}")
    return target


def with_on_path(env: dict[str, str], target: Path) -> dict[str, str]:
    """``env`` with ``target`` first on ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return env
