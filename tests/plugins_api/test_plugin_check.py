"""``enginecore plugins --check`` on real (throwaway) distributions, and start-up errors
that name the plugin and the component.

Each distribution is a ``*.dist-info`` plus a module in a directory put on
``PYTHONPATH`` for a real ``enginecore`` subprocess, the way pip would lay it out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import enginecore
from enginecore.engine.core import EngineCore
from enginecore.plugins import make_plugin_manager
from enginecore.startup_errors import ComponentStartupError
from enginecore.version import PLUGIN_API_VERSION

ENGINECORE = Path(sys.executable).parent / "enginecore"


def add_distribution(site: Path, dist: str, module: str, source: str, version: str = "1.0"):
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    entry = module.removeprefix("enginecore_")
    (info / "entry_points.txt").write_text(f"[enginecore]\n{entry} = {module}\n")


def run_check(site: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINECORE_")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [str(ENGINECORE), "plugins", "--check", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


GOOD = """
    import enginecore
    from enginecore.interfaces import SchedulingPolicy

    class Newest(SchedulingPolicy):
        def sort_key(self, request):
            return (-request.seq_no,)

    @enginecore.hookimpl
    def plugin_api_versions():
        return ">=1.0,<2"

    @enginecore.hookimpl
    def register_scheduling_policies(registry):
        registry.add("newest", Newest)
"""

BROKEN = {
    "undecorated": """
        from enginecore.interfaces import StatLogger

        class Quiet(StatLogger):
            def record(self, scheduler_stats, iteration_stats, engine_index=0):
                pass

        def register_stat_loggers(registry):
            registry.add("quiet", Quiet)
    """,
    "badref": """
        import enginecore

        @enginecore.hookimpl
        def plugin_api_versions():
            return ">=1.0,<2"

        @enginecore.hookimpl
        def register_executors(registry):
            registry.add("typo", "enginecore_badref:PodExecutr")
    """,
    "wrongbase": """
        import enginecore

        class NotAPolicy:
            def sort_key(self, request):
                return request.seq_no

        @enginecore.hookimpl
        def plugin_api_versions():
            return ">=1.0,<2"

        @enginecore.hookimpl
        def register_scheduling_policies(registry):
            registry.add("loose", NotAPolicy)
    """,
    "abstract": """
        import enginecore
        from enginecore.interfaces import StatLogger

        class Half(StatLogger):
            pass

        @enginecore.hookimpl
        def plugin_api_versions():
            return ">=1.0,<2"

        @enginecore.hookimpl
        def register_stat_loggers(registry):
            registry.add("half", Half)
    """,
    "future": """
        import enginecore

        @enginecore.hookimpl
        def plugin_api_versions():
            return ">=2.0,<3"

        @enginecore.hookimpl
        def register_stat_loggers(registry):
            pass
    """,
    "badargs": """
        import enginecore

        @enginecore.hookimpl
        def register_stat_loggers(registry, config):
            pass
    """,
}


@pytest.fixture
def site(tmp_path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    return site


def test_a_healthy_plugin_passes(site):
    add_distribution(site, "enginecore-newest", "enginecore_newest", GOOD)
    result = run_check(site)
    assert result.returncode == 0, result.stderr
    assert "newest  (enginecore-newest 1.0)" in result.stdout
    assert "check: all plugins passed the checks" in result.stderr


def test_every_kind_of_mistake_is_reported_with_its_distribution(site):
    for name, source in BROKEN.items():
        add_distribution(site, f"enginecore-{name}", f"enginecore_{name}", source)
    result = run_check(site)
    assert result.returncode == 1
    err = result.stderr
    assert (
        "error: plugin 'undecorated' (distribution enginecore-undecorated 1.0): function "
        "register_stat_loggers() is not decorated with @enginecore.hookimpl" in err
    )
    assert "plugin 'badref' (distribution enginecore-badref 1.0)" in err
    assert "'enginecore_badref:PodExecutr'" in err and "PodExecutr" in err
    assert "'loose' is <class 'enginecore_wrongbase.NotAPolicy'>, not a subclass of " in err
    assert "enginecore.interfaces.SchedulingPolicy" in err
    assert "does not implement the abstract methods record of StatLogger" in err
    assert (
        "plugin 'future' (distribution enginecore-future 1.0) supports plugin API >=2.0,<3, "
        f"but this enginecore provides plugin API {PLUGIN_API_VERSION}" in err
    )
    assert "plugin 'badargs' (distribution enginecore-badargs 1.0)" in err
    assert "The spec is register_stat_loggers(registry)" in err
    assert "warning: plugin 'undecorated'" in err and "declares no plugin_api_versions()" in err
    assert "check: 6 problem(s) to fix" in err


def test_json_check_lists_the_problems_per_plugin(site):
    add_distribution(site, "enginecore-abstract", "enginecore_abstract", BROKEN["abstract"])
    result = run_check(site, "--json")
    assert result.returncode == 1
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "abstract"]
    assert record["distribution"] == "enginecore-abstract"
    [problem] = record["problems"]
    assert problem["severity"] == "error" and "abstract methods record" in problem["message"]


def test_api_versions_may_be_a_plain_attribute(monkeypatch):
    monkeypatch.delenv("ENGINECORE_STRICT_PLUGINS", raising=False)

    class Declares:
        plugin_api_versions = ">=99"

        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            pass

    host = make_plugin_manager(load_entrypoints=False, builtins={})
    record = host.register_object(Declares(), "declares")
    assert not record.loaded
    assert "supports plugin API >=99" in record.error


# --- start-up errors name the plugin and the component ------------------------------


def boom_plugin():
    from enginecore.interfaces import SchedulingPolicy

    class BoomPolicy(SchedulingPolicy):
        def __init__(self, config):
            raise KeyError("tenant_weights")

        def sort_key(self, request):
            return request.seq_no

    class Plugin:
        @enginecore.hookimpl
        def register_scheduling_policies(self, registry):
            registry.add("boom", BoomPolicy)

    return Plugin()


def test_a_component_that_raises_at_start_up_is_named(tiny_llama):
    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(boom_plugin(), "boomer")
    config = enginecore.make_config(
        model=str(tiny_llama), scheduling_policy="boom", num_blocks_override=32, dtype="float32"
    )
    with pytest.raises(ComponentStartupError) as info:
        EngineCore(config, host)
    message = str(info.value)
    assert message.startswith(
        "scheduling policy 'boom' from plugin 'boomer' (distribution <object>) failed to "
        "start: KeyError: 'tenant_weights'."
    )
    assert "config key scheduler.policy" in message
    assert "see" not in message.lower().split("failed to start")[1]
    assert isinstance(info.value.__cause__, KeyError)


class BoomRunner(enginecore.interfaces.ModelRunner):
    """A runner plugin with a bug in its constructor (abstract methods unused)."""

    def __init__(self, config, worker_spec, device=None, parallel=None):
        raise RuntimeError("cuda graph capture is not supported on cpu")

    load_model = determine_available_memory = get_kv_cache_block_bytes = None
    get_max_model_len = initialize_kv_cache = execute_model = sample_tokens = None


def test_a_runner_that_raises_in_a_worker_is_named(tiny_llama):
    class Plugin:
        @enginecore.hookimpl
        def register_model_runners(self, registry):
            registry.add("boom", BoomRunner)

    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(Plugin(), "boom_runner")
    config = enginecore.make_config(model=str(tiny_llama), runner="boom", num_blocks_override=8)
    with pytest.raises(enginecore.errors.EngineCoreError) as info:
        EngineCore(config, host)
    message = str(info.value)
    assert (
        f"model runner 'boom' ({__name__}:BoomRunner) failed to start on rank 0: RuntimeError: "
        "cuda graph capture is not supported on cpu. Fix the plugin that provides it, or "
        "select another runner (config key model.runner)."
    ) in message


def test_a_stat_logger_that_raises_when_built_is_named():
    from enginecore.interfaces import StatLogger
    from enginecore.metrics.manager import StatLoggerManager

    class NeedsAPath(StatLogger):
        def __init__(self, config, engine_index=0):
            raise FileNotFoundError("/var/log/engine/stats.jsonl")

        def record(self, scheduler_stats, iteration_stats, engine_index=0):
            pass

    class Plugin:
        @enginecore.hookimpl
        def register_stat_loggers(self, registry):
            registry.add("needs-path", NeedsAPath)

    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(Plugin(), "pathy")
    config = enginecore.make_config(stat_loggers=["logging", "needs-path"])
    with pytest.raises(ComponentStartupError) as info:
        StatLoggerManager(config, host)
    assert str(info.value) == (
        "stat logger 'needs-path' from plugin 'pathy' (distribution <object>) failed to "
        "start: FileNotFoundError: /var/log/engine/stats.jsonl. Fix the plugin, or select "
        "another stat logger (config key observability.stat_loggers)."
    )
