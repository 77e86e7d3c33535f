"""The docs cannot drift from the code (datasette's meta-tests, adapted).

- every hook in ``enginecore.hookspecs`` has a heading in the hook reference
  ``docs/hooks.md`` showing its exact signature, and no heading names a hook that is gone;
- every hook has a test function named ``test_hook_<name>`` somewhere in ``tests/``;
- every config section and flat name is documented in ``docs/configuration.md``;
- every plugin env var and built-in plugin is documented in ``docs/plugin_operations.md``,
  every interface in ``docs/plugins.md``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from enginecore import hookspecs, interfaces
from enginecore.config import FLAT_NAMES, SECTIONS
from enginecore.plugins import builtin_plugins
from tests.helpers.hook_specs import HOOKS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# ``### `name(arg: Type, ...) -> Result` `` in docs/hooks.md
HOOK_HEADING = re.compile(r"^### `(\w+)\((.*)\) -> .*`", re.M)


def documented_hooks() -> dict[str, list[str]]:
    text = (DOCS / "hooks.md").read_text()
    return {
        name: re.findall(r"(?:^|, )(\w+)(?::|$|,)", args)
        for name, args in HOOK_HEADING.findall(text)
    }


def test_the_spec_module_defines_the_hooks_we_check():
    spec_functions = {
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, "enginecore_spec")
    }
    assert spec_functions == set(HOOKS)
    assert {"register_schedulers", "engine_started", "plugin_api_versions"} <= set(HOOKS)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_plugin_hooks_are_documented(hook):
    documented = documented_hooks()
    expected = f"### `{hook}({', '.join(HOOKS[hook])})`"
    assert hook in documented, f"docs/hooks.md has no heading {expected}"
    assert documented[hook] == HOOKS[hook], (
        f"docs/hooks.md documents {hook}({', '.join(documented[hook])}) but the spec is "
        f"{hook}({', '.join(HOOKS[hook])})"
    )


def test_no_documented_hook_is_missing_from_the_specs():
    assert set(documented_hooks()) <= set(HOOKS)


def test_hook_docs_are_in_spec_order():
    """The reference reads top to bottom like hookspecs.py (lifecycle order)."""
    source = inspect.getsource(hookspecs)
    spec_order = sorted(HOOKS, key=lambda name: source.index(f"def {name}("))
    assert list(documented_hooks()) == spec_order


@pytest.fixture(scope="module")
def hook_test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^\s*(?:async )?def (test_hook_\w+)\(", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_plugin_hooks_have_tests(hook, hook_test_names):
    assert f"test_hook_{hook}" in hook_test_names, f"no test named test_hook_{hook} in tests/"


def test_every_config_key_is_documented():
    text = (DOCS / "configuration.md").read_text()
    for section in SECTIONS:
        assert f"### {section}\n" in text, f"configuration.md has no section {section}"
    for flat, (section, field) in FLAT_NAMES.items():
        flag = "--" + flat.replace("_", "-")
        row = re.search(rf"^\| `{field}` \| `{flat}` / `{flag}`", text, re.M)
        assert row, f"configuration.md has no row for {section}.{field} ({flag})"


def test_plugin_env_vars_and_builtins_are_documented():
    text = (DOCS / "plugin_operations.md").read_text()
    plugins_source = (ROOT / "core" / "enginecore" / "plugins.py").read_text()
    env_vars = set(re.findall(r'"(ENGINECORE_\w+)"', plugins_source))
    assert len(env_vars) == 5
    for var in env_vars:
        assert f"`{var}`" in text, f"plugin_operations.md does not document {var}"
    for module in builtin_plugins().values():
        assert f"`{module}`" in text, f"plugin_operations.md does not list the built-in {module}"


def test_every_interface_is_documented():
    text = (DOCS / "plugins.md").read_text()
    abcs = [
        name
        for name, cls in inspect.getmembers(interfaces, inspect.isclass)
        if cls.__module__ == interfaces.__name__ and inspect.isabstract(cls)
    ]
    assert "StatLogger" in abcs and "SchedulingPolicy" in abcs
    for name in abcs:
        assert f"| `{name}` |" in text, f"plugins.md does not describe interfaces.{name}"
    assert "PLUGIN_API_VERSION" in text


def test_docs_link_only_to_files_that_exist():
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().exists(), f"{page.name} links to {target}"
