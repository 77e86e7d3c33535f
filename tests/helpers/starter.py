"""``enginecore plugin new`` end to end: generate, pip-install into a fresh venv, check, test."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.fresh_venv import FreshVenv


def build_and_test(kind: str, tmp_path: Path, model: Path, select_in_engine: bool) -> None:
    venv = FreshVenv(tmp_path / "venv")
    package = tmp_path / "enginecore-tally"
    made = venv.sh(f"enginecore plugin new enginecore-tally --kind {kind}", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert f"created {kind} plugin 'enginecore-tally' in {package}" in made.stdout
    # The README's own commands, in its order.
    for command in ("pip install -e '.[test]'", "enginecore plugins --check"):
        result = venv.sh(command, cwd=package)
        assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    check = venv.sh("enginecore plugins --check --json", cwd=package)
    [record] = [r for r in json.loads(check.stdout) if r["name"] == "tally"]
    assert record["distribution"] == "enginecore-tally" and record["problems"] == []
    tests = venv.sh("python -m pytest -q -p no:cacheprovider", cwd=package)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert " passed" in tests.stdout and "failed" not in tests.stdout
    if select_in_engine:
        # The README's engine.toml selects it; a real engine starts and generates with it.
        readme = (package / "README.md").read_text()
        toml = readme.split("```toml\n# engine.toml\n", 1)[1].split("```", 1)[0]
        dtype = '[model]\ndtype = "float32"\n'
        toml = toml.replace("[model]\n", dtype) if "[model]\n" in toml else toml + dtype
        (package / "engine.toml").write_text(toml + "\n[cache]\nnum_blocks_override = 64\n")
        run = venv.sh(
            f"enginecore generate {model} --config engine.toml --max-tokens 3 --prompt hi",
            cwd=package,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert run.stdout.startswith("'hi' -> ")
