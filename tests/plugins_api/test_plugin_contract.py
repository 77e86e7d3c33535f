"""The plugin contract's promises: containment, all-or-nothing loading, wrappers, checks.

Plugins here are real installed distributions (a ``*.dist-info`` with entry points on
``sys.path``, found by importlib-metadata as any installed package is) or in-process
objects registered with ``register_object``; every hook goes through the real pluggy.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import msgspec
import pytest

import enginecore
from enginecore import cli
from enginecore.config import make_config
from enginecore.errors import ConfigError, PluginLoadError
from enginecore.interfaces import StatLogger
from enginecore.metrics.manager import StatLoggerManager
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.plugins import make_plugin_manager
from enginecore.startup_errors import ComponentStartupError

ENGINECORE = Path(sys.executable).parent / "enginecore"
ENV_VARS = (
    "ENGINECORE_PLUGINS",
    "ENGINECORE_DISABLE_PLUGINS",
    "ENGINECORE_STRICT_PLUGINS",
    "ENGINECORE_TRACE_PLUGINS",
)
METRICS_AND_SCHEDULERS = {
    "builtin_stat_loggers": "enginecore_stat_loggers.plugin",
    "builtin_schedulers": "enginecore_schedulers.plugin",
}


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


class Site:
    """A directory on ``sys.path`` (and ``PYTHONPATH``) holding installed distributions."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def plugin(self, ep_name: str, source: str, version: str = "1.0") -> str:
        module = f"{ep_name}_plugin_{uuid.uuid4().hex[:8]}"
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        self.modules.append(module)
        dist = f"enginecore-{ep_name}"
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[enginecore]\n{ep_name} = {module}\n")
        return module


@pytest.fixture
def site(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    found = Site(root)
    yield found
    for name in found.modules:
        sys.modules.pop(name, None)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), *args], capture_output=True, text=True, env=dict(os.environ), timeout=120
    )


GOOD = """
    import enginecore

    @enginecore.hookimpl
    def register_stat_loggers(registry):
        registry.add("good_logger", "collections:OrderedDict")
"""


# --- 2. whatever a plugin raises at import is contained and named ---------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import sys\nsys.exit(3)\n", "SystemExit: 3 (the plugin called sys.exit())"),
        (
            "import argparse\nargparse.ArgumentParser().parse_args(['--no-such-flag'])\n",
            "SystemExit: 2 (the plugin called sys.exit())",
        ),
        ("raise KeyboardInterrupt\n", "KeyboardInterrupt"),
        ("class Odd(BaseException):\n    pass\nraise Odd('odd')\n", "Odd: odd"),
    ],
    ids=["sys.exit", "argparse-at-import", "KeyboardInterrupt", "BaseException"],
)
def test_any_exception_at_import_is_contained_and_names_the_distribution(
    site, caplog, source, expected
):
    site.plugin("exiting", source, version="0.2.0")
    site.plugin("healthy", GOOD)
    host = make_plugin_manager(builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"})
    record = host.records["exiting"]
    assert record.error == f"failed to load: {expected}"
    assert "'exiting' (distribution enginecore-exiting 0.2.0)" in caplog.text
    assert host.registry("stat_logger").entry("good_logger").plugin == "healthy"


def test_a_plugin_exiting_at_import_leaves_the_cli_working(site):
    site.plugin("exiting", "import sys\nsys.exit(1)\n", version="0.2.0")
    listing = run_cli("plugins")
    assert listing.returncode == 0, listing.stderr
    assert "exiting  (enginecore-exiting 0.2.0)  [FAILED]" in listing.stdout
    assert "error: failed to load: SystemExit: 1 (the plugin called sys.exit())" in listing.stdout
    shown = run_cli("config", "show")
    assert shown.returncode == 0, shown.stderr
    assert "[scheduler]" in shown.stdout


# --- 3. a failed plugin contributes nothing, whichever registry is built first --------------


class HalfBroken:
    """Replaces the built-in "logging" stat logger, then fails in another hook."""

    def __init__(self) -> None:
        self.finished: list = []

    @enginecore.hookimpl
    def register_stat_loggers(self, registry):
        registry.add("logging", "collections:OrderedDict", override=True)

    @enginecore.hookimpl
    def register_schedulers(self, registry):
        raise RuntimeError("needs a license server")

    @enginecore.hookimpl
    def request_finished(self, request_stats):
        self.finished.append(request_stats)


@pytest.mark.parametrize("first", ["stat_logger", "scheduler"])
def test_a_plugin_failing_in_one_hook_is_removed_from_every_registry(first):
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_AND_SCHEDULERS)
    plugin = HalfBroken()
    host.register_object(plugin, "half_broken")
    host.registry(first)
    record = host.records["half_broken"]
    assert "raised in register_schedulers: RuntimeError: needs a license server" in record.error
    assert host.registry("stat_logger").entry("logging").plugin == "builtin_stat_loggers"
    assert record.registered == {}
    host.request_finished(FinishedRequestStats(request_id="r", finish_reason="stop"))
    assert plugin.finished == []  # its observers are gone too


def test_a_failure_at_registration_is_fatal_in_strict_mode(monkeypatch):
    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_AND_SCHEDULERS)
    host.register_object(HalfBroken(), "half_broken")
    with pytest.raises(PluginLoadError, match="license server") as info:
        host.registry("stat_logger")
    assert len(str(info.value)) < 400  # one line; the cause carries the traceback
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_override_holds_whichever_hook_ran_first():
    host = make_plugin_manager(
        load_entrypoints=False, builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}
    )

    class Better:
        @enginecore.hookimpl(tryfirst=True)  # runs before the built-in registers "logging"
        def register_stat_loggers(self, registry):
            registry.add("logging", "collections:OrderedDict", override=True)

    host.register_object(Better(), "better")
    entry = host.registry("stat_logger").entry("logging")
    assert (entry.plugin, entry.overrides) == ("better", "builtin_stat_loggers")
    assert host.records["better"].loaded and host.records["builtin_stat_loggers"].loaded


def test_a_duplicate_name_drops_the_later_plugin_not_the_builtin():
    host = make_plugin_manager(
        load_entrypoints=False, builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}
    )

    class Clash:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add("prometheus", "collections:OrderedDict")

    host.register_object(Clash(), "clash")
    assert host.registry("stat_logger").entry("prometheus").plugin == "builtin_stat_loggers"
    assert host.records["builtin_stat_loggers"].loaded
    assert "registered twice" in host.records["clash"].error


# --- 8. pluggy wrappers --------------------------------------------------------------------


def test_a_new_style_wrapper_sees_and_extends_every_registration():
    host = make_plugin_manager(
        load_entrypoints=False, builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}
    )

    class Timing:
        @enginecore.hookimpl(wrapper=True)
        def register_stat_loggers(self, registry):
            result = yield
            for name in list(registry.names()):
                registry.add(f"timed_{name}", "collections:OrderedDict")
            return result

    host.register_object(Timing(), "timing")
    registry = host.registry("stat_logger")
    assert registry.entry("timed_logging").plugin == "timing"
    assert registry.entry("timed_prometheus").plugin == "timing"
    assert host.records["timing"].registered == {
        "stat_logger": ["timed_logging", "timed_prometheus"]
    }


def test_an_old_style_hookwrapper_observes_lifecycle_calls():
    host = make_plugin_manager(load_entrypoints=False, builtins={})
    seen: list[tuple[str, str]] = []

    class Observer:
        @enginecore.hookimpl
        def request_finished(self, request_stats):
            seen.append(("observer", request_stats.request_id))

    class Around:
        @enginecore.hookimpl(hookwrapper=True)
        def request_finished(self, request_stats):
            seen.append(("before", request_stats.request_id))
            outcome = yield
            outcome.get_result()
            seen.append(("after", request_stats.request_id))

    host.register_object(Observer(), "observer")
    host.register_object(Around(), "around")
    host.request_finished(FinishedRequestStats(request_id="r1", finish_reason="stop"))
    assert seen == [("before", "r1"), ("observer", "r1"), ("after", "r1")]


def test_a_raising_observer_does_not_silence_a_wrapper_or_the_others(caplog):
    host = make_plugin_manager(load_entrypoints=False, builtins={})
    seen: list[str] = []

    class Raises:
        @enginecore.hookimpl
        def engine_stopped(self, reason):
            raise SystemExit("plugin exits in a hook")

    class Counts:
        @enginecore.hookimpl
        def engine_stopped(self, reason):
            seen.append(reason)

    host.register_object(Raises(), "raises")
    host.register_object(Counts(), "counts")
    host.engine_stopped("shutdown")
    assert seen == ["shutdown"]
    assert "plugin 'raises' raised in engine_stopped (ignored)" in caplog.text


# --- 7. component names are checked before anything starts ----------------------------------


def test_config_show_rejects_unknown_component_names_with_did_you_mean(capsys):
    code = cli.main(
        ["config", "show", "--scheduling-policy", "fcfss", "--stat-loggers", "logging,promethus"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "scheduler.policy: unknown scheduling policy 'fcfss'. Did you mean 'fcfs'?" in err
    assert (
        "fair_share (from builtin_schedulers), fcfs (from builtin_schedulers), "
        "priority (from builtin_schedulers)"
    ) in err
    assert "observability.stat_loggers: unknown stat logger 'promethus'." in err
    assert "Did you mean 'prometheus'?" in err


def test_config_show_accepts_known_names(capsys):
    assert cli.main(["config", "show", "--scheduling-policy", "priority"]) == 0
    assert 'policy = "priority"' in capsys.readouterr().out


def test_llm_refuses_an_unknown_policy_before_starting_an_engine(tmp_path):
    from enginecore import LLM

    with pytest.raises(ConfigError, match=r"scheduler.policy: unknown scheduling policy 'no_s"):
        LLM(model=str(tmp_path / "no-checkpoint-needed"), scheduling_policy="no_such_policy")


# --- 5. plugin settings from the config file ------------------------------------------------


class CsvSettings(msgspec.Struct, kw_only=True):
    path: str
    every_n_steps: int = 1


class CsvStatLogger(StatLogger):
    def __init__(self, config, engine_index=0, *, settings: CsvSettings):
        super().__init__(config, engine_index)
        self.settings = settings

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        return None


class CsvPlugin:
    plugin_settings = CsvSettings

    @enginecore.hookimpl
    def register_stat_loggers(self, registry):
        registry.add("csv", CsvStatLogger)


def csv_host():
    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(CsvPlugin(), "csv_stats")
    return host


def test_a_plugin_table_in_the_config_file_reaches_the_component(tmp_path):
    from enginecore.component_check import check_components

    config_file = tmp_path / "engine.toml"
    config_file.write_text(
        '[observability]\nstat_loggers = ["csv"]\n\n'
        '[plugins.csv_stats]\npath = "/data/stats.csv"\nevery_n_steps = 4\n'
    )
    config = make_config(config_file)
    assert config.plugins.config == {"csv_stats": {"path": "/data/stats.csv", "every_n_steps": 4}}
    host = csv_host()
    check_components(config, host)
    [stat_logger] = StatLoggerManager(config, host).loggers
    assert stat_logger.settings == CsvSettings(path="/data/stats.csv", every_n_steps=4)
    # The same settings, for code enginecore does not build (a hook, a worker RPC).
    from enginecore.plugin_settings import plugin_settings

    assert plugin_settings(config, "csv_stats", CsvSettings).every_n_steps == 4
    # And as a keyword, like every other config field.
    kwarg = make_config(plugin_config={"csv_stats": {"path": "x.csv"}})
    assert plugin_settings(kwarg, "csv_stats", CsvSettings) == CsvSettings(path="x.csv")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            {"csv_stats": {"pth": "x"}},
            "[plugins.csv_stats]: unknown key 'pth' for plugin 'csv_stats'. Did you mean 'path'?",
        ),
        (
            {"csv_stats": {"path": "x", "every_n_steps": "often"}},
            "[plugins.csv_stats]: invalid settings for plugin 'csv_stats': key 'every_n_steps'",
        ),
        ({"csv_stat": {"path": "x"}}, "no plugin named 'csv_stat' is loaded. Did you mean"),
    ],
    ids=["misspelt-key", "wrong-type", "misspelt-plugin"],
)
def test_a_bad_plugin_table_names_the_plugin_and_the_key(table, message):
    from enginecore.component_check import check_components

    config = make_config(plugin_config=table)
    with pytest.raises(ConfigError) as info:
        check_components(config, csv_host())
    assert message in str(info.value)


# --- 9. smaller promises --------------------------------------------------------------------


class NotAStatLogger:
    """Takes the stat logger's arguments, but has no ``record``."""

    def __init__(self, config, engine_index=0):
        self.config = config


def test_a_stat_logger_factory_building_the_wrong_thing_fails_at_start_up():
    host = make_plugin_manager(load_entrypoints=False, builtins={})

    class Wrong:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add("wrong", NotAStatLogger)

    host.register_object(Wrong(), "wrong_plugin")
    with pytest.raises(ComponentStartupError, match=r"'wrong' from plugin 'wrong_plugin'.*not a"):
        StatLoggerManager(make_config(stat_loggers=["wrong"]), host)


def test_a_misspelt_allow_list_warns_with_did_you_mean(site, monkeypatch, caplog):
    site.plugin("healthy", GOOD)
    monkeypatch.setenv("ENGINECORE_PLUGINS", "healthyy")
    host = make_plugin_manager(builtins={})
    assert "healthy" not in host.records
    assert "'healthyy', which no installed plugin or distribution is called" in caplog.text
    assert "Did you mean 'healthy'" in caplog.text


def test_two_distributions_with_one_entry_point_name_both_named(site, caplog):
    site.plugin("twin", GOOD, version="1.0")
    module = f"twin_plugin_{uuid.uuid4().hex[:8]}"
    (site.root / f"{module}.py").write_text(textwrap.dedent(GOOD))
    info = site.root / "other_twin-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-twin\nVersion: 2.0\n")
    (info / "entry_points.txt").write_text(f"[enginecore]\ntwin = {module}\n")
    make_plugin_manager(builtins={})
    warning = next(r.getMessage() for r in caplog.records if "two installed" in r.getMessage())
    assert "enginecore-twin" in warning and "other-twin" in warning


def test_a_plugin_failure_is_warned_once_per_process_tree(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="enginecore.plugins")
    for _ in range(2):  # the engine process and each worker build their own host
        host = make_plugin_manager(load_entrypoints=False, builtins=METRICS_AND_SCHEDULERS)
        host.register_object(HalfBroken(), "half_broken")
        host.registry("scheduler")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "half_broken" in warnings[0].getMessage()
    assert os.environ["ENGINECORE_WARNED_PLUGINS"] == "half_broken"  # children inherit it


def test_plugins_json_lists_the_settings_free_record_fields(site):
    site.plugin("exiting", "raise SystemExit(5)\n")
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "exiting"]
    assert record["error"] == "failed to load: SystemExit: 5 (the plugin called sys.exit())"


MANY_PROBLEMS = """
    import enginecore

    class NotAPolicy:
        pass

    @enginecore.hookimpl
    def register_schedulers(reg):  # wrong argument name: the plugin fails to load
        pass

    @enginecore.hookimpl
    def register_scheduling_policies(registry):
        registry.add("not_a_policy", NotAPolicy)

    def register_executors(registry):  # not decorated
        pass
"""


def test_check_reports_every_problem_of_a_failed_plugin(site):
    site.plugin("many", MANY_PROBLEMS)
    result = run_cli("plugins", "--check", "--json")
    assert result.returncode == 1
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "many"]
    messages = [p["message"] for p in record["problems"]]
    assert len(messages) == 3, messages
    assert "register_schedulers(reg)" in messages[0]
    assert any("'not_a_policy'" in m and "SchedulingPolicy" in m for m in messages)
    assert any("register_executors() is not decorated" in m for m in messages)


def test_collective_rpc_takes_its_arguments_in_one_order_everywhere():
    """vLLM's order, (method, timeout, args, kwargs), for the frontends and executors."""
    import inspect

    from enginecore import LLM, AsyncLLM
    from enginecore.engine.core import EngineCore
    from enginecore.interfaces import Executor
    from enginecore_executors.multiproc import MultiprocExecutor
    from enginecore_executors.ray_executor import RayExecutor
    from enginecore_executors.uniproc import UniProcExecutor

    for owner in (
        LLM,
        AsyncLLM,
        EngineCore,
        Executor,
        UniProcExecutor,
        MultiprocExecutor,
        RayExecutor,
    ):
        names = list(inspect.signature(owner.collective_rpc).parameters)[1:5]
        assert names == ["method", "timeout", "args", "kwargs"], owner


def test_a_broken_plugin_does_not_fail_another_plugins_kit_tests(site, monkeypatch):
    from enginecore.testing import SchedulingPolicyContract, StatLoggerContract

    site.plugin("exploding", "raise RuntimeError('broken beyond repair')\n")
    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")  # as under `make test`

    class TestPriority(SchedulingPolicyContract):
        policy = "priority"

    class TestLogging(StatLoggerContract):
        stat_logger = "logging"

    TestPriority().test_queue_order_does_not_depend_on_arrival_order_or_history()
    TestLogging().test_does_not_mutate_the_stats_it_receives()
    with pytest.raises(PluginLoadError, match="broken beyond repair"):
        make_plugin_manager()  # strict mode itself is unchanged


def test_the_start_up_components_name_the_models_plugin(tiny_llama):
    from enginecore.engine.components import resolve_components

    config = make_config(model=str(tiny_llama))
    providers = resolve_components(config, make_plugin_manager(load_entrypoints=False)).providers
    assert providers["model"] == "LlamaForCausalLM (from builtin_models)"


class RecordingStatLogger(StatLogger):
    records: list = []

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        if iteration_stats is not None:
            type(self).records.extend(iteration_stats.finished_requests)


@pytest.mark.slow
def test_llm_reports_requests_it_aborts_like_async_llm(tiny_llama):
    """Interrupted mid-generate: the unfinished request reaches the stat loggers and
    request_finished with finish reason abort. The logger is registered in-process only,
    so the engine, which never builds stat loggers, must not look for it."""
    from enginecore import LLM, SamplingParams

    finished: list = []

    class Plugin:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add("recording", RecordingStatLogger)

        @enginecore.hookimpl
        def request_finished(self, request_stats):
            finished.append(request_stats)
            if len(finished) == 1:
                raise KeyboardInterrupt  # Ctrl-C as the first request finishes

    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(Plugin(), "interrupting")
    RecordingStatLogger.records = []
    with LLM(model=str(tiny_llama), plugin_host=host, stat_loggers=["recording"]) as llm:
        params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=200, ignore_eos=True)]
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["short", "long"], params)
        assert llm.engine_client.ready.components["stat_loggers"] == "recording"
    assert [(s.request_id, s.finish_reason) for s in finished] == [("0", "length"), ("1", "abort")]
    assert [s.finish_reason for s in RecordingStatLogger.records] == ["length", "abort"]


HALF_BROKEN = """
    import enginecore

    @enginecore.hookimpl
    def register_stat_loggers(registry):
        registry.add("logging", "collections:OrderedDict", override=True)

    @enginecore.hookimpl
    def register_schedulers(registry):
        raise RuntimeError("needs a license server")
"""


@pytest.mark.slow
def test_the_frontend_and_the_engine_process_agree_on_a_failed_plugin(site, tiny_llama):
    from enginecore import LLM
    from enginecore_stat_loggers.logging_logger import LoggingStatLogger

    site.plugin("half_broken", HALF_BROKEN)
    with LLM(model=str(tiny_llama), stat_loggers=["logging"]) as llm:
        assert not llm.plugins.records["half_broken"].loaded
        assert type(llm.stat_loggers.loggers[0]) is LoggingStatLogger
        components = llm.engine_client.ready.components
    assert components["stat_loggers"] == "logging (from builtin_stat_loggers)"
    assert components["scheduler"] == "default (from builtin_schedulers)"
