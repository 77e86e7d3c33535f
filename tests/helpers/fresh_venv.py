"""A fresh virtual environment that sees this venv's packages, for install-from-scratch tests.

Creating a venv and pip-installing torch, transformers, ... into it takes minutes and
needs the network. Instead the fresh venv (``python -m venv --without-pip``) gets one
``.pth`` file that adds this venv's site-packages *after* its own (``site.addsitedir``,
so editable installs there keep working): enginecore and its dependencies are
importable, while whatever the test pip-installs lands in the fresh venv. Installs run
with ``--no-deps --no-build-isolation`` (through ``PIP_NO_DEPS`` / ``PIP_NO_BUILD_ISOLATION``)
since the dependencies are already there and the machine is offline; that is the one
deviation from a user's plain ``pip install``.

``bin/pip``, ``bin/pytest`` and ``bin/enginecore`` are small wrappers around this interpreter, so a
README's commands run literally with the fresh venv first on ``PATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

PLUGIN_ENV_VARS = (
    "ENGINECORE_WARNED_PLUGINS",
    "ENGINECORE_PLUGINS",
    "ENGINECORE_DISABLE_PLUGINS",
    "ENGINECORE_STRICT_PLUGINS",
    "ENGINECORE_TRACE_PLUGINS",
    "PYTEST_ADDOPTS",
    "PYTHONPATH",
)


class FreshVenv:
    def __init__(self, root: Path) -> None:
        self.root = root
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120
        )
        self.python = root / "bin" / "python"
        purelib = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        parent = sysconfig.get_paths()["purelib"]
        Path(purelib, "_parent_venv.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
        # Console scripts as pip would write them (the working directory is not put on
        # sys.path, unlike ``python -m``).
        tools = (
            ("pip", "pip._internal.cli.main", "main"),
            ("pytest", "pytest", "console_main"),
            ("enginecore", "enginecore.cli", "main"),
        )
        for tool, module, function in tools:
            script = root / "bin" / tool
            script.write_text(
                f"#!{self.python}\nimport sys\nfrom {module} import {function}\n"
                f"sys.exit({function}())\n"
            )
            script.chmod(0o755)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV_VARS}
        env.update(
            PATH=f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            VIRTUAL_ENV=str(self.root),
            PIP_NO_DEPS="1",
            PIP_NO_BUILD_ISOLATION="0",  # pip's inverted env flag: "0" turns isolation off
            PIP_DISABLE_PIP_VERSION_CHECK="1",
            PIP_NO_INPUT="1",
        )
        return env

    def sh(self, command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        """Run one shell command as a user would, inside this venv."""
        return subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
