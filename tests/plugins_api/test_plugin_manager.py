"""The plugin system, tested with real pluggy, real importlib-metadata and real entry points.

Throwaway distributions are written into a temporary directory as a ``*.dist-info``
folder (``METADATA`` + ``entry_points.txt``) next to the plugin module, and that
directory is put on ``sys.path``: importlib-metadata discovers them exactly as it
discovers an installed package.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import enginecore
from enginecore import cli, hookspecs
from enginecore.config import make_config
from enginecore.errors import (
    DuplicateRegistrationError,
    IncompatiblePluginError,
    PluginLoadError,
    UnknownComponentError,
)
from enginecore.plugins import COMPONENT_HOOKS, builtin_plugins, make_plugin_manager
from enginecore.registry import Registry

ENV_VARS = (
    "ENGINECORE_WARNED_PLUGINS",
    "ENGINECORE_PLUGINS",
    "ENGINECORE_DISABLE_PLUGINS",
    "ENGINECORE_STRICT_PLUGINS",
    "ENGINECORE_TRACE_PLUGINS",
)
# Strict-mode tests load only this built-in, so that they do not depend on which other
# built-in plugin modules exist yet.
METRICS_ONLY = {"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch):
    """Each test starts from the default selection (CI runs with strict mode on)."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


class Distributions:
    """Writes throwaway installed distributions into one directory on ``sys.path``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def unique(self, stem: str) -> str:
        return f"{stem}_{uuid.uuid4().hex[:8]}"

    def module(self, name: str, source: str) -> str:
        (self.root / f"{name}.py").write_text(textwrap.dedent(source))
        self.modules.append(name)
        return name

    def add(self, dist_name: str, entry_points: dict[str, str], version: str = "1.0") -> None:
        info = self.root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
        )
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[enginecore]\n{lines}")

    def plugin(self, ep_name: str, source: str, version: str = "1.0") -> str:
        """A distribution ``enginecore-<ep_name>`` whose one entry point is ``source``."""
        module = self.module(self.unique(f"{ep_name}_plugin"), source)
        self.add(f"enginecore-{ep_name}", {ep_name: module}, version)
        return module


@pytest.fixture
def dists(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))  # for subprocesses
    found = Distributions(root)
    yield found
    for name in found.modules:
        sys.modules.pop(name, None)


GOOD_PLUGIN = """
    import enginecore

    @enginecore.hookimpl
    def register_stat_loggers(registry):
        registry.add("{name}", "collections:OrderedDict", summary="test logger")
"""

BROKEN_PLUGIN = """
    import enginecore

    raise RuntimeError("boom: this plugin cannot import its backend")
"""


def test_every_registration_hook_has_a_registry():
    register_hooks = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert register_hooks == set(COMPONENT_HOOKS.values())


# --- built-ins ----------------------------------------------------------------------


def test_builtins_register_through_the_same_hooks():
    host = make_plugin_manager(load_entrypoints=False)
    assert {r.module for r in host.records.values()} == set(builtin_plugins().values())
    assert all(r.builtin and r.distribution == "builtin" for r in host.records.values())

    metrics = host.records["builtin_stat_loggers"]
    assert metrics.loaded, metrics.error
    assert metrics.hooks == ["register_stat_loggers"]
    # The built-in module is an ordinary pluggy plugin whose impl is marked trylast.
    assert host.pm.get_plugin("builtin_stat_loggers") is importlib.import_module(
        "enginecore_stat_loggers.plugin"
    )
    [impl] = [
        i
        for i in host.pm.hook.register_stat_loggers.get_hookimpls()
        if i.plugin_name == "builtin_stat_loggers"
    ]
    assert impl.trylast

    class ThirdParty:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add("mine", "collections:Counter")

    host.register_object(ThirdParty(), "thirdparty")
    registry = host.registry("stat_logger")
    assert {n: registry.entry(n).plugin for n in registry} == {
        "logging": "builtin_stat_loggers",
        "prometheus": "builtin_stat_loggers",
        "mine": "thirdparty",
    }
    assert host.records["builtin_stat_loggers"].registered == {
        "stat_logger": ["logging", "prometheus"]
    }


def test_each_builtin_declares_its_own_entry_point():
    """Every ``builtin_<kind>/`` distribution registers through the ``enginecore`` entry
    point group, as a third-party package does; the host finds them there, first."""
    import tomllib

    import importlib_metadata

    root = Path(__file__).resolve().parents[2]
    folders = sorted(p.parent for p in root.glob("builtin_*/pyproject.toml"))
    assert len(folders) >= 10
    installed = {ep.name: ep.value for ep in importlib_metadata.entry_points(group="enginecore")}
    for folder in folders:
        kind = folder.name.removeprefix("builtin_")
        declared = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        expected = {folder.name: f"enginecore_{kind}.plugin"}
        assert declared.get("entry-points", {}).get("enginecore") == expected, folder.name
        assert installed.get(folder.name) == expected[folder.name], "reinstall: make install"
    assert set(builtin_plugins()) == {f.name for f in folders}
    host = make_plugin_manager()
    names = list(host.records)
    assert names[: len(folders)] == list(builtin_plugins())  # built-ins load first
    assert all(host.records[f.name].builtin for f in folders)


def test_a_builtin_can_be_disabled_and_the_allow_list_keeps_builtins():
    from enginecore.plugin_attribution import _plugin_packages

    host = make_plugin_manager(disabled=["builtin_gpu"])
    assert "builtin_gpu" not in host.records
    assert "gguf_triton" not in host.registry("linear_method")
    assert "unquantized" in host.registry("linear_method")
    allow = make_plugin_manager(enabled=["no_such_plugin"])
    assert set(builtin_plugins()) <= set(allow.records)
    # Built-in code is enginecore's: errors from it are never attributed to a plugin.
    packages = {module.split(".")[0] for module in builtin_plugins().values()}
    assert not packages & set(_plugin_packages()), _plugin_packages()


@pytest.mark.parametrize("name", list(builtin_plugins()))
def test_each_existing_builtin_loads_and_registers_something(name):
    module = builtin_plugins()[name]
    host = make_plugin_manager(load_entrypoints=False, builtins={name: module})
    [record] = host.records.values()
    assert record.loaded, record.traceback
    host.all_registries()
    assert record.registered, f"{module} registered no component"


# --- duplicates and overrides -------------------------------------------------------


def _registers(name: str, *, override: bool = False):
    class Plugin:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add(name, "collections:OrderedDict", override=override)

    return Plugin()


def test_registry_rejects_a_duplicate_naming_both_plugins():
    registry: Registry = Registry(kind="scheduler")
    registry._current_plugin = "first"
    registry.add("fast", "collections:OrderedDict")
    registry._current_plugin = "second"
    with pytest.raises(DuplicateRegistrationError) as info:
        registry.add("fast", "collections:Counter")
    message = str(info.value)
    assert "'fast'" in message and "'first'" in message and "'second'" in message
    assert registry.entry("fast").plugin == "first"


def test_duplicate_name_from_two_plugins_names_both(caplog):
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_ONLY)
    host.register_object(_registers("twice"), "plugin_a")
    host.register_object(_registers("twice"), "plugin_b")
    registry = host.registry("stat_logger")
    # Non-strict: the second plugin is recorded as failed; the first keeps the name.
    assert registry.entry("twice").plugin == "plugin_a"
    error = host.records["plugin_b"].error
    assert "registered twice" in error
    assert "'plugin_a'" in error and "'plugin_b'" in error
    assert "plugin_b" in caplog.text and "registered twice" in caplog.text


def test_duplicate_name_is_fatal_in_strict_mode(monkeypatch):
    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_ONLY)
    host.register_object(_registers("logging"), "clash")
    with pytest.raises(PluginLoadError) as info:
        host.registry("stat_logger")
    assert "'builtin_stat_loggers'" in str(info.value) and "'clash'" in str(info.value)
    assert isinstance(info.value.__cause__, DuplicateRegistrationError)


def test_override_replaces_and_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="enginecore.registry")
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_ONLY)
    host.register_object(_registers("logging", override=True), "better_logging")
    entry = host.registry("stat_logger").entry("logging")
    assert entry.plugin == "better_logging"
    assert entry.overrides == "builtin_stat_loggers"
    assert entry.factory == "collections:OrderedDict"
    assert "'better_logging' overrides the one from plugin 'builtin_stat_loggers'" in caplog.text


# --- unknown names ------------------------------------------------------------------


def test_unknown_name_lists_available_names_providers_and_failed_plugins():
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_ONLY)

    class Misspelled:
        @enginecore.hookimpl
        def register_stat_logers(self, registry):  # sic
            registry.add("fancy", "collections:OrderedDict")

    host.register_object(Misspelled(), "fancy_stats")
    with pytest.raises(UnknownComponentError) as info:
        host.registry("stat_logger").get("fancy")
    message = str(info.value)
    assert "unknown stat logger 'fancy'" in message
    assert (
        "logging (from builtin_stat_loggers)" in message
        and "prometheus (from builtin_stat_loggers)" in message
    )
    assert "failed to load" in message and "'fancy_stats'" in message


def test_config_selecting_an_unknown_name_fails_listing_the_choices():
    config = make_config(stat_loggers=["logging", "nope"])
    registry = make_plugin_manager(load_entrypoints=False, builtins=METRICS_ONLY).registry(
        "stat_logger"
    )
    assert registry.get(config.observability.stat_loggers[0]).__name__ == "LoggingStatLogger"
    with pytest.raises(UnknownComponentError, match=r"'nope'.*logging.*prometheus"):
        registry.get(config.observability.stat_loggers[1])


# --- plugins that fail to load ------------------------------------------------------


def test_plugin_that_raises_on_import_is_recorded_and_warned(dists, caplog):
    dists.plugin("broken", BROKEN_PLUGIN, version="0.3.1")
    dists.plugin("healthy", GOOD_PLUGIN.format(name="healthy"))
    host = make_plugin_manager(builtins=METRICS_ONLY)

    record = host.records["broken"]
    assert not record.loaded
    assert (record.distribution, record.version) == ("enginecore-broken", "0.3.1")
    assert "RuntimeError: boom: this plugin cannot import its backend" in record.error
    assert "Traceback" in record.traceback and "broken_plugin_" in record.traceback
    assert "'broken' (distribution enginecore-broken 0.3.1)" in caplog.text
    # The others still load, and the failure is named when a name is missing.
    registry = host.registry("stat_logger")
    assert registry.entry("healthy").plugin == "healthy"
    with pytest.raises(UnknownComponentError, match="enginecore-broken"):
        registry.get("what-broken-would-have-provided")


def test_plugin_that_raises_on_import_is_shown_by_the_plugins_command(dists, capsys):
    dists.plugin("broken", BROKEN_PLUGIN, version="0.3.1")
    assert cli.main(["plugins", "-v"]) == 0
    out = capsys.readouterr()
    assert "broken  (enginecore-broken 0.3.1)  [FAILED]" in out.out
    assert "error: failed to load: RuntimeError: boom" in out.out
    assert "Traceback (most recent call last)" in out.out
    assert "plugin(s) failed to load" in out.err
    assert cli.main(["plugins", "--check"]) == 1


def test_plugin_that_raises_on_import_is_fatal_in_strict_mode(dists, monkeypatch):
    dists.plugin("broken", BROKEN_PLUGIN, version="0.3.1")
    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError) as info:
        make_plugin_manager(builtins=METRICS_ONLY)
    message = str(info.value)
    assert "enginecore-broken 0.3.1" in message
    assert "RuntimeError: boom" in message
    assert "ENGINECORE_STRICT_PLUGINS=1" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_misspelled_hook_name_is_an_error_naming_plugin_and_hook(dists, monkeypatch):
    dists.plugin(
        "typo",
        """
        import enginecore

        @enginecore.hookimpl
        def register_schedulrs(registry):
            registry.add("x", "collections:OrderedDict")
        """,
    )
    host = make_plugin_manager(builtins=METRICS_ONLY)
    error = host.records["typo"].error
    assert "unknown hook 'register_schedulrs'" in error
    assert "Did you mean 'register_schedulers'" in error
    assert "'typo'" not in error  # the record is the plugin's: its name is said once, outside
    assert host.pm.get_plugin("typo") is None  # unregistered again

    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=r"'typo'.*register_schedulrs"):
        make_plugin_manager(builtins=METRICS_ONLY)


def test_wrong_argument_names_are_an_error_naming_the_plugin(dists):
    dists.plugin(
        "badargs",
        """
        import enginecore

        @enginecore.hookimpl
        def register_schedulers(reg):
            reg.add("x", "collections:OrderedDict")
        """,
    )
    host = make_plugin_manager(builtins=METRICS_ONLY)
    record = host.records["badargs"]
    assert not record.loaded
    assert "register_schedulers" in record.error
    assert "reg" in record.error
    assert "x" not in host.registry("scheduler")


def test_a_subset_of_the_hook_arguments_is_accepted():
    class Observer:
        seen: list = []

        @enginecore.hookimpl
        def engine_started(self, info):
            self.seen.append(info)

    host = make_plugin_manager(load_entrypoints=False, builtins={})
    host.register_object(Observer(), "observer")
    assert host.records["observer"].loaded
    host.engine_started(make_config(), {"num_blocks": 7})
    assert Observer.seen == [{"num_blocks": 7}]


# --- selection: allow-list, block-list, config section --------------------------------


@pytest.fixture
def alpha_beta(dists):
    dists.plugin("alpha", GOOD_PLUGIN.format(name="alpha"))
    dists.plugin("beta", GOOD_PLUGIN.format(name="beta"))
    return dists


def _third_party(host) -> set[str]:
    return {r.name for r in host.records.values() if not r.builtin}


def test_all_installed_plugins_load_by_default(alpha_beta):
    host = make_plugin_manager(builtins=METRICS_ONLY)
    assert {"alpha", "beta"} <= _third_party(host)
    assert {"alpha", "beta", "logging"} <= set(host.registry("stat_logger"))


def test_allow_list_env_var(alpha_beta, monkeypatch):
    monkeypatch.setenv("ENGINECORE_PLUGINS", "alpha")
    host = make_plugin_manager(builtins=METRICS_ONLY)
    assert _third_party(host) == {"alpha"}
    assert set(host.registry("stat_logger")) == {"alpha", "logging", "prometheus"}
    # The distribution name works as well as the entry-point name.
    monkeypatch.setenv("ENGINECORE_PLUGINS", "enginecore-beta")
    assert _third_party(make_plugin_manager(builtins=METRICS_ONLY)) == {"beta"}


def test_empty_allow_list_loads_no_third_party_plugin(alpha_beta, monkeypatch):
    monkeypatch.setenv("ENGINECORE_PLUGINS", "")
    host = make_plugin_manager(builtins=METRICS_ONLY)
    assert _third_party(host) == set()
    assert set(host.registry("stat_logger")) == {"logging", "prometheus"}  # built-ins stay


def test_disable_env_var_blocks_third_party_and_builtin_plugins(alpha_beta, monkeypatch):
    monkeypatch.setenv("ENGINECORE_DISABLE_PLUGINS", "beta, builtin_stat_loggers")
    host = make_plugin_manager(builtins=METRICS_ONLY)
    assert "alpha" in _third_party(host) and "beta" not in _third_party(host)
    assert "builtin_stat_loggers" not in host.records
    names = set(host.registry("stat_logger"))
    assert "alpha" in names and not names & {"beta", "logging"}


def test_config_plugins_section_and_env_precedence(alpha_beta, monkeypatch):
    config = make_config(enabled_plugins=["alpha", "beta"], disabled_plugins=["beta"])
    host = make_plugin_manager(
        config.plugins.enabled, config.plugins.disabled, builtins=METRICS_ONLY
    )
    assert _third_party(host) == {"alpha"}
    # The env allow-list replaces the config's; the env block-list adds to it.
    monkeypatch.setenv("ENGINECORE_PLUGINS", "beta")
    host = make_plugin_manager(["alpha"], [], builtins=METRICS_ONLY)
    assert _third_party(host) == {"beta"}


# --- tracing --------------------------------------------------------------------------


def test_trace_env_var_prints_hook_calls(alpha_beta, monkeypatch, capsys):
    monkeypatch.setenv("ENGINECORE_TRACE_PLUGINS", "1")
    host = make_plugin_manager(builtins=METRICS_ONLY)
    host.registry("stat_logger")
    host.engine_stopped("shutdown")
    err = capsys.readouterr().err
    assert "[enginecore]" in err
    assert "register_stat_loggers" in err and "'alpha'" in err and "'builtin_stat_loggers'" in err
    assert "engine_stopped" not in err  # no plugin implements it: nothing to trace

    monkeypatch.delenv("ENGINECORE_TRACE_PLUGINS")
    make_plugin_manager(builtins=METRICS_ONLY).registry("stat_logger")
    assert "[enginecore]" not in capsys.readouterr().err


# --- plugin API versions ----------------------------------------------------------------


def test_incompatible_plugin_api_versions_is_refused(dists, monkeypatch):
    dists.plugin(
        "future",
        """
        import enginecore

        @enginecore.hookimpl
        def plugin_api_versions():
            return ">=2.0,<3"

        @enginecore.hookimpl
        def register_stat_loggers(registry):
            registry.add("future", "collections:OrderedDict")
        """,
        version="5.0",
    )
    host = make_plugin_manager(builtins=METRICS_ONLY)
    record = host.records["future"]
    assert not record.loaded
    assert ">=2.0,<3" in record.error and enginecore.PLUGIN_API_VERSION in record.error
    assert "enginecore-future 5.0" in record.describe()
    assert "future" not in host.registry("stat_logger")

    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match=r">=2\.0,<3") as info:
        make_plugin_manager(builtins=METRICS_ONLY)
    assert isinstance(info.value.__cause__, IncompatiblePluginError)


# --- lazy references --------------------------------------------------------------------


def test_lazy_reference_is_imported_only_when_selected(dists):
    lazy_module = dists.module(
        dists.unique("lazy_component"),
        """
        class Heavy:
            pass
        """,
    )
    dists.plugin(
        "lazy",
        f"""
        import enginecore

        @enginecore.hookimpl
        def register_stat_loggers(registry):
            registry.add("heavy", "{lazy_module}:Heavy")
            registry.add("missing", "{lazy_module}:DoesNotExist")
        """,
    )
    host = make_plugin_manager(builtins=METRICS_ONLY)
    registry = host.registry("stat_logger")
    assert registry.entry("heavy").factory == f"{lazy_module}:Heavy"
    assert lazy_module not in sys.modules

    heavy = registry.get("heavy")
    assert heavy.__name__ == "Heavy" and heavy.__module__ == lazy_module
    assert lazy_module in sys.modules
    assert registry.entry("heavy").ref == f"{lazy_module}:Heavy"
    with pytest.raises(PluginLoadError, match=r"'missing' from plugin 'lazy'.*DoesNotExist"):
        registry.get("missing")
