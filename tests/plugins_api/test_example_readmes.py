"""Each example package in ``plugins/`` builds in a fresh venv from its README's commands.

The commands of the README's ``bash`` blocks that install, check and test the package
(``pip install ...``, ``enginecore plugins ...``, ``cd ...``, ``python -m pytest``,
``pytest ...``) run literally, in order, from the repository root, inside a fresh venv
(see fresh_venv.py: it sees this venv's packages, and pip runs with ``--no-deps
--no-build-isolation`` since the machine is offline). Commands that start a server or
need a model (``enginecore serve``, ``jq``) are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.fresh_venv import FreshVenv

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (REPO / "plugins").iterdir() if (p / "README.md").exists())
RUNNABLE = ("pip install", "enginecore plugins", "cd ", "python -m pytest", "pytest ")


def readme_commands(readme: Path) -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if command.startswith(RUNNABLE):
                commands.append(command)
    return commands


def test_every_example_readme_has_install_and_test_commands():
    assert EXAMPLES == [
        "enginecore-cycle-proposer",
        "enginecore-echo-executor",
        "enginecore-jsonl-stats",
        "enginecore-sjf",
    ]
    for name in EXAMPLES:
        commands = readme_commands(REPO / "plugins" / name / "README.md")
        assert any(c.startswith("pip install") for c in commands), name
        assert any("pytest" in c for c in commands), name


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_builds_in_a_fresh_venv_from_its_readme(name, tmp_path):
    venv = FreshVenv(tmp_path / "venv")
    commands = readme_commands(REPO / "plugins" / name / "README.md")
    script = " && ".join(["set -e", *commands])
    result = venv.sh(script, cwd=REPO, timeout=900)
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"
    assert " passed" in result.stdout and " failed" not in result.stdout
    module = name.replace("-", "_")
    installed = list((tmp_path / "venv").glob(f"lib/*/site-packages/{module}-*.dist-info"))
    assert installed, f"{name} was not installed into the fresh venv"
