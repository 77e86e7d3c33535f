"""The example plugin packages in ``plugins/``, pip-installed into the running venv.

This is the offline version of llm's "install two real plugins and look at ``llm
plugins``" CI step: the packages are installed the way a user installs them, and every
assertion goes through the public surface (the ``enginecore`` console script, a config
naming the component, the registry).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore import make_config
from enginecore.errors import UnknownComponentError
from enginecore.interfaces import IterationStats
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.plugins import make_plugin_manager
from enginecore.protocol import SchedulerStats
from tests.helpers.editable_installs import add_editable_paths, is_current

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIRS = {
    "enginecore-sjf": REPO / "plugins" / "enginecore-sjf",
    "enginecore-jsonl-stats": REPO / "plugins" / "enginecore-jsonl-stats",
}
ENGINECORE = Path(sys.executable).parent / "enginecore"
PLUGIN_ENV_VARS = (
    "ENGINECORE_PLUGINS",
    "ENGINECORE_DISABLE_PLUGINS",
    "ENGINECORE_STRICT_PLUGINS",
    "ENGINECORE_TRACE_PLUGINS",
)


@pytest.fixture(scope="session")
def installed_plugins() -> dict[str, Path]:
    """pip-install both packages (editable, no deps) once; a no-op when already current."""
    lock_path = Path(sys.prefix) / ".enginecore-test-plugins.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two pytest runs must not pip-install at once
        stale = [p for name, p in PLUGIN_DIRS.items() if not is_current(name, p)]
        if stale:
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input"]
            command += ["--disable-pip-version-check", "--no-deps", "--no-build-isolation"]
            for path in stale:
                command += ["-e", str(path)]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                pytest.fail(f"pip install failed:\n{result.stdout}\n{result.stderr}")
        for name, path in PLUGIN_DIRS.items():
            assert is_current(name, path), f"{name} is not installed from {path}"
            add_editable_paths(name)
    return PLUGIN_DIRS


@pytest.fixture
def clean_env(monkeypatch) -> dict[str, str]:
    for name in PLUGIN_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


def run_enginecore(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), *args], capture_output=True, text=True, env=env, timeout=120
    )


def plugins_json(env: dict[str, str]) -> dict[str, dict]:
    result = run_enginecore("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return {record["name"]: record for record in json.loads(result.stdout)}


def test_plugins_command_shows_both_packages(installed_plugins, clean_env):
    records = plugins_json(clean_env)
    sjf, jsonl = records["sjf"], records["jsonl_stats"]
    assert {k: sjf[k] for k in ("distribution", "version", "builtin", "error")} == {
        "distribution": "enginecore-sjf",
        "version": "0.1.0",
        "builtin": False,
        "error": None,
    }
    assert sjf["module"] == "enginecore_sjf.plugin"
    assert sjf["hooks"] == ["plugin_api_versions", "register_scheduling_policies"]
    assert sjf["registered"] == {"scheduling_policy": ["sjf"]}
    assert sjf["api_versions"] == ">=1.0,<2"

    assert (jsonl["distribution"], jsonl["version"]) == ("enginecore-jsonl-stats", "0.1.0")
    assert jsonl["hooks"] == ["plugin_api_versions", "register_stat_loggers"]
    assert jsonl["registered"] == {"stat_logger": ["jsonl"]}
    assert jsonl["error"] is None
    # Built-ins are listed by the same command, marked as such.
    assert records["builtin_stat_loggers"]["builtin"] is True
    assert records["builtin_stat_loggers"]["registered"] == {
        "stat_logger": ["logging", "prometheus"]
    }


def test_plugins_command_honours_the_allow_list(installed_plugins, clean_env):
    only_sjf = plugins_json({**clean_env, "ENGINECORE_PLUGINS": "enginecore-sjf"})
    assert "sjf" in only_sjf and "jsonl_stats" not in only_sjf
    none = plugins_json({**clean_env, "ENGINECORE_PLUGINS": ""})
    assert not [name for name, r in none.items() if not r["builtin"]]
    blocked = plugins_json({**clean_env, "ENGINECORE_DISABLE_PLUGINS": "sjf"})
    assert "sjf" not in blocked and "jsonl_stats" in blocked


def test_config_selecting_sjf_resolves_to_the_plugin_class(installed_plugins, clean_env, tmp_path):
    from enginecore_sjf.policy import ShortestJobFirstPolicy

    config_file = tmp_path / "engine.toml"
    config_file.write_text('[scheduler]\npolicy = "sjf"\n')
    config = make_config(config_file)
    host = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
    registry = host.registry("scheduling_policy")
    assert registry.entry(config.scheduler.policy).plugin == "sjf"
    policy_cls = registry.get(config.scheduler.policy)
    assert policy_cls is ShortestJobFirstPolicy
    assert policy_cls(config).name == "sjf"


def test_config_selecting_an_unknown_policy_lists_every_provider(installed_plugins, clean_env):
    config = make_config(scheduling_policy="nope")
    registry = make_plugin_manager().registry("scheduling_policy")
    with pytest.raises(UnknownComponentError) as info:
        registry.get(config.scheduler.policy)
    message = str(info.value)
    assert "unknown scheduling policy 'nope'" in message
    assert "fcfs (from builtin_schedulers)" in message
    assert "priority (from builtin_schedulers)" in message
    assert "sjf (from sjf)" in message


def test_the_jsonl_stat_logger_is_selectable(installed_plugins, clean_env, monkeypatch, tmp_path):
    from enginecore_jsonl_stats import JsonlStatLogger

    path = tmp_path / "stats.jsonl"
    monkeypatch.setenv("ENGINECORE_JSONL_STATS_PATH", str(path))
    config = make_config(model="tiny", stat_loggers=["logging", "jsonl"])
    registry = make_plugin_manager().registry("stat_logger")
    loggers = [registry.get(name)(config, 0) for name in config.observability.stat_loggers]
    assert isinstance(loggers[1], JsonlStatLogger)
    done = FinishedRequestStats(request_id="req-1", finish_reason="stop", extra={"run": 7})
    for logger in loggers:
        logger.record(SchedulerStats(num_running_reqs=1), IterationStats(finished_requests=[done]))
    loggers[1].close()
    [line] = [json.loads(text) for text in path.read_text().splitlines()]
    assert line["scheduler"]["num_running_reqs"] == 1
    assert line["finished_requests"][0]["request_id"] == "req-1"
    assert line["finished_requests"][0]["extra"] == {"run": 7}


@pytest.mark.parametrize("dist_name", sorted(PLUGIN_DIRS))
def test_the_packages_own_test_suites_pass(installed_plugins, clean_env, dist_name):
    """A plugin author copies the package with its tests; those tests must pass as shipped."""
    with contextlib.suppress(KeyError):
        del clean_env["PYTEST_ADDOPTS"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=installed_plugins[dist_name],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_the_engine_resolves_both_plugins_at_start_up(installed_plugins, clean_env):
    """The engine's own start-up resolution picks the plugins' components by config."""
    from enginecore_sjf.policy import ShortestJobFirstPolicy

    from enginecore.engine.components import resolve_components

    config = make_config(scheduling_policy="sjf", stat_loggers=["prometheus", "jsonl"])
    components = resolve_components(config, make_plugin_manager())
    assert components.policy_cls is ShortestJobFirstPolicy
    assert components.providers["scheduling_policy"] == "sjf (from sjf)"
    assert components.providers["stat_loggers"] == (
        "prometheus (from builtin_stat_loggers), jsonl (from jsonl_stats)"
    )


def _finished_records(path: Path) -> list[dict]:
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    return [record for line in lines for record in line["finished_requests"]]


@pytest.mark.slow
def test_llm_builds_the_selected_stat_loggers_and_calls_request_finished(
    installed_plugins, clean_env, tiny_llama, tmp_path
):
    """Offline, as under AsyncLLM: the jsonl logger writes and every observer is told."""
    import enginecore
    from enginecore import LLM, SamplingParams

    finished: list[FinishedRequestStats] = []

    class Observer:
        @enginecore.hookimpl
        def request_finished(self, request_stats):
            finished.append(request_stats)

    host = make_plugin_manager()
    host.register_object(Observer(), "observer")
    path = tmp_path / "stats.jsonl"
    llm = LLM(
        model=str(tiny_llama),
        plugin_host=host,
        stat_loggers=["jsonl"],
        plugin_config={"jsonl_stats": {"path": str(path)}},
    )
    try:
        llm.generate(["Hello", "World"], SamplingParams(max_tokens=4, extra={"user": "alice"}))
    finally:
        llm.shutdown()
    records = _finished_records(path)
    assert sorted(r["request_id"] for r in records) == ["0", "1"]
    assert all(r["extra"] == {"user": "alice"} and r["num_generation_tokens"] == 4 for r in records)
    assert sorted(s.request_id for s in finished) == ["0", "1"]
    assert llm.stat_loggers.loggers[0]._file is None  # closed at shutdown


@pytest.mark.slow
def test_generate_command_writes_through_the_configured_stat_logger(
    installed_plugins, clean_env, tiny_llama, tmp_path
):
    path = tmp_path / "run1.jsonl"
    config_file = tmp_path / "engine.toml"
    config_file.write_text(
        '[observability]\nstat_loggers = ["logging", "jsonl"]\n\n'
        f'[plugins.jsonl_stats]\npath = "{path}"\n'
    )
    result = run_enginecore(
        "generate",
        str(tiny_llama),
        "--config",
        str(config_file),
        "--prompt",
        "Hello",
        "--max-tokens",
        "3",
        env=clean_env,
    )
    assert result.returncode == 0, result.stderr
    [record] = _finished_records(path)
    assert record["finish_reason"] == "length" and record["num_generation_tokens"] == 3
