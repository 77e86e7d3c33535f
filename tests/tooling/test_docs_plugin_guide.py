"""The plugin guide (docs/plugins.md) and the operations page (docs/plugin_operations.md)
cannot drift from the kit, the starter, the RPCs or the API versions."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import enginecore.testing
from enginecore import interfaces
from enginecore.starter.templates import KINDS
from enginecore.version import PLUGIN_API_VERSION
from enginecore_executors.debug_rpcs import DEBUG_RPCS
from tests.helpers.hook_specs import HOOKS

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "plugins.md").read_text()
OPERATIONS = (ROOT / "docs" / "plugin_operations.md").read_text()


def stability_rows() -> dict[str, tuple[str, str]]:
    section = OPERATIONS.split("## Versions and stability", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)`[^|]* \| (stable|provisional) \| ([\d.]+) \|$", section, re.M)
    return {name: (level, since) for name, level, since in rows}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_every_hook_has_a_stability_level(hook):
    signature = f"{hook}({', '.join(HOOKS[hook])})"
    assert signature in stability_rows(), f"the stability table has no row for {signature}"


def test_every_interface_has_a_stability_level():
    abcs = [
        name
        for name, cls in inspect.getmembers(interfaces, inspect.isclass)
        if cls.__module__ == interfaces.__name__ and inspect.isabstract(cls)
    ]
    rows = stability_rows()
    for name in abcs:
        assert name in rows, f"the stability table has no row for interfaces.{name}"


def test_the_changelog_has_the_current_version():
    section = OPERATIONS.split("**What changed, per version.**", 1)[1]
    assert f"| {PLUGIN_API_VERSION} |" in section
    assert f"currently `{PLUGIN_API_VERSION}`" in OPERATIONS
    assert f"currently `{PLUGIN_API_VERSION}`" in GUIDE


def test_every_contract_and_fixture_is_documented():
    for name in enginecore.testing.__all__:
        assert f"| `{name}` |" in GUIDE, f"plugins.md does not describe {name}"
    fixtures = [n for n in dir(enginecore.testing) if n.startswith("enginecore_")]
    assert len(fixtures) == 5
    for name in fixtures:
        assert f"| `{name}` |" in GUIDE, f"plugins.md does not describe the fixture {name}"


def test_every_starter_kind_and_debug_rpc_is_documented():
    for kind in KINDS:
        assert f"| `{kind}` |" in GUIDE, f"the walkthrough table has no row for --kind {kind}"
    for rpc in DEBUG_RPCS:
        assert re.search(rf"^\| `{rpc}(\(|`)", OPERATIONS, re.M), f"no row for the RPC {rpc}"


def test_every_example_package_is_in_the_quick_start():
    for package in sorted((ROOT / "plugins").iterdir()):
        assert f"[`plugins/{package.name}`](../plugins/{package.name})" in GUIDE
