"""``enginecore plugins``: the human-readable listing, failures, ``-v``, ``--check``, strict.

Run as a real subprocess of the installed console script, with a throwaway broken
distribution put on ``PYTHONPATH`` (importlib-metadata finds its ``*.dist-info``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from enginecore import cli
from enginecore.version import PLUGIN_API_VERSION, __version__

ENGINECORE = Path(sys.executable).parent / "enginecore"


@pytest.fixture
def env(monkeypatch) -> dict[str, str]:
    for name in (
        "ENGINECORE_WARNED_PLUGINS",
        "ENGINECORE_PLUGINS",
        "ENGINECORE_DISABLE_PLUGINS",
        "ENGINECORE_STRICT_PLUGINS",
        "ENGINECORE_TRACE_PLUGINS",
    ):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


@pytest.fixture
def broken_site(tmp_path) -> Path:
    """A directory holding an installed distribution whose plugin module raises on import."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "enginecore_exploding_plugin.py").write_text(
        textwrap.dedent(
            """
            import enginecore

            def _connect():
                raise ConnectionError("metrics backend at localhost:9999 refused")

            _connect()
            """
        )
    )
    info = site / "enginecore_exploding-2.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: enginecore-exploding\nVersion: 2.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[enginecore]\nexploding = enginecore_exploding_plugin\n"
    )
    return site


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_lists_builtins_first_with_module_hooks_and_components(env, capsys, monkeypatch):
    monkeypatch.setenv("ENGINECORE_PLUGINS", "")  # built-ins only, whatever is installed
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert (
        "builtin_stat_loggers  (builtin)\n"
        "    module: enginecore_stat_loggers.plugin\n"
        "    hooks: register_stat_loggers\n"
        "    stat_logger: logging, prometheus\n"
    ) in out
    names = [line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert names == sorted(names) and "builtin_stat_loggers" in names
    assert all("(builtin)" in line for line in out.splitlines() if line and line[0] != " ")


def test_a_broken_plugin_is_shown_with_its_distribution_and_error(env, broken_site):
    env = {**env, "PYTHONPATH": str(broken_site)}
    result = run("plugins", env=env)
    assert result.returncode == 0  # listing still works with a broken plugin installed
    block = result.stdout[result.stdout.index("exploding  (") :]
    assert block.startswith("exploding  (enginecore-exploding 2.1.0)  [FAILED]\n")
    assert "    module: enginecore_exploding_plugin\n" in block
    assert (
        "    error: failed to load: ConnectionError: metrics backend at localhost:9999 refused"
        in block
    )
    assert "Traceback" not in result.stdout
    assert "1 plugin(s) failed to load; run with -v for tracebacks." in result.stderr
    # The load warning names the distribution too.
    assert "'exploding' (distribution enginecore-exploding 2.1.0)" in result.stderr


def test_verbose_shows_the_original_traceback(env, broken_site):
    result = run("plugins", "-v", env={**env, "PYTHONPATH": str(broken_site)})
    assert "    Traceback (most recent call last):" in result.stdout
    assert "enginecore_exploding_plugin.py" in result.stdout
    assert "in _connect" in result.stdout


def test_check_exits_nonzero_only_when_a_plugin_failed(env, broken_site):
    assert run("plugins", "--check", env=env).returncode == 0
    broken_env = {**env, "PYTHONPATH": str(broken_site)}
    assert run("plugins", "--check", env=broken_env).returncode == 1
    result = run("plugins", "--json", "--check", env=broken_env)
    assert result.returncode == 1
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "exploding"]
    assert record["distribution"] == "enginecore-exploding" and record["version"] == "2.1.0"
    assert "ConnectionError" in record["error"] and "_connect" in record["traceback"]


def test_strict_mode_lists_every_plugin_and_exits_nonzero(env, broken_site):
    """The listing is the diagnostic: strict mode must not take it down at the first failure."""
    strict_env = {**env, "PYTHONPATH": str(broken_site), "ENGINECORE_STRICT_PLUGINS": "1"}
    result = run("plugins", env=strict_env)
    assert result.returncode == 1
    assert "exploding  (enginecore-exploding 2.1.0)  [FAILED]" in result.stdout
    assert "builtin_stat_loggers  (builtin)" in result.stdout  # the rest is listed too
    assert "strict mode (ENGINECORE_STRICT_PLUGINS=1): a plugin failed" in result.stderr
    assert run("plugins", env={**env, "ENGINECORE_STRICT_PLUGINS": "1"}).returncode == 0


def test_disabling_the_broken_plugin_is_the_escape_hatch(env, broken_site):
    env = {**env, "PYTHONPATH": str(broken_site), "ENGINECORE_STRICT_PLUGINS": "1"}
    result = run("plugins", env={**env, "ENGINECORE_DISABLE_PLUGINS": "enginecore-exploding"})
    assert result.returncode == 0, result.stderr
    assert "exploding" not in result.stdout


def test_version_names_the_plugin_api(env):
    result = run("--version", env=env)
    assert result.stdout.strip() == f"enginecore {__version__} (plugin API {PLUGIN_API_VERSION})"
