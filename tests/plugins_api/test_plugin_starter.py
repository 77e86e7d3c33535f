"""``enginecore plugin new``: the package it writes installs with pip in a fresh venv,
passes ``enginecore plugins --check`` and its own conformance tests unchanged, and a
config file selects it in a real engine.

The fresh venv sees this venv's packages through a ``.pth`` file (see fresh_venv.py);
installs run with ``--no-deps --no-build-isolation`` because the machine is offline.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore.starter.cli import StarterError, create_plugin, derive_names
from enginecore.starter.templates import KINDS
from tests.helpers.starter import build_and_test

ENGINECORE = Path(sys.executable).parent / "enginecore"


def test_names_follow_the_distribution_name():
    names = derive_names("enginecore-fair-share", KINDS["scheduler-policy"])
    assert names.dist == "enginecore-fair-share"
    assert names.package == "enginecore_fair_share"
    assert names.entry_point == "fair_share"
    assert names.component == "fair-share"
    assert names.cls == "FairSharePolicy"
    model = derive_names("enginecore-tinyphi", KINDS["model"])
    assert model.component == model.cls == "TinyphiForCausalLM"  # an architecture name


def test_bad_requests_are_refused_with_what_to_change(tmp_path):
    with pytest.raises(StarterError, match="not a valid distribution name"):
        create_plugin("3 policies!", "executor", tmp_path / "x")
    with pytest.raises(StarterError, match="unknown plugin kind 'router'; choose one of"):
        create_plugin("enginecore-r", "router", tmp_path / "y")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(StarterError, match="already exists and is not empty"):
        create_plugin("enginecore-z", "executor", tmp_path / "taken")
    assert (tmp_path / "taken" / "file").read_text() == "mine"  # nothing overwritten
    result = subprocess.run(
        [str(ENGINECORE), "plugin", "new", "enginecore-z", "--kind", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "invalid choice: 'nope'" in result.stderr


def test_every_starter_builds_on_the_public_api_only(tmp_path):
    """Built-in plugin packages (``enginecore_<kind>``) are internal: no starter imports
    one, so a generated plugin keeps working whatever they become."""
    for kind in sorted(KINDS):
        package = tmp_path / kind
        create_plugin("enginecore-tally", kind, package)
        for source in package.rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                internal = [
                    n
                    for n in names
                    if n.startswith("enginecore_") and n.split(".")[0] != "enginecore_tally"
                ]
                assert not internal, f"{kind}: {source.name} imports {internal}"


def test_a_new_stat_logger_plugin_installs_and_passes_its_tests(tmp_path, tiny_llama):
    build_and_test("stat-logger", tmp_path, tiny_llama, select_in_engine=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_installs_and_passes_its_tests(kind, tmp_path, tiny_llama):
    engine = kind in (
        "scheduler-policy",
        "executor",
        "stat-logger",
        "attention-backend",
        "linear-method",
    )
    build_and_test(kind, tmp_path, tiny_llama, select_in_engine=engine)
