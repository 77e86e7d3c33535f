"""``PLUGIN_API_VERSION`` is frozen: the plugin API cannot change without a version bump.

The API here is every hook's name and arguments, every public method of the interfaces
a plugin implements (with its signature), the fields of the data a plugin receives and
``Registry.add``. It is compared with ``plugin_api_snapshot.json``, taken at one
version. A difference fails until ``PLUGIN_API_VERSION`` is bumped and
``docs/plugin_operations.md``'s change table has a line for the new version; then
``ENGINECORE_UPDATE_API_SNAPSHOT=1`` records the new snapshot.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from enginecore import hookspecs, interfaces
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.protocol import SchedulerStats
from enginecore.registry import Registry
from enginecore.version import PLUGIN_API_VERSION

SNAPSHOT = Path(__file__).with_name("plugin_api_snapshot.json")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
CHANGELOG = Path(__file__).resolve().parents[2] / "docs" / "plugin_operations.md"
INTERFACES = (
    "SchedulingPolicy",
    "Scheduler",
    "Executor",
    "Worker",
    "ModelRunner",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVConnectorFactory",
    "SpecDecodeProposer",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StatLogger",
)
DATA = {
    "SchedulerState": interfaces.SchedulerState,
    "IterationStats": interfaces.IterationStats,
    "SchedulerStats": SchedulerStats,
    "FinishedRequestStats": FinishedRequestStats,
    "WorkerSpec": interfaces.WorkerSpec,
}


def _signature(obj: Any) -> str:
    return str(inspect.signature(obj)).replace("'", "")


def _fields(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    if issubclass(cls, msgspec.Struct):
        return list(cls.__struct_fields__)
    raise TypeError(cls)


def current_api() -> dict[str, Any]:
    hooks = {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT_NAME}_spec")
    }
    methods = {}
    for name in INTERFACES:
        cls = getattr(interfaces, name)
        methods[name] = {
            attr: _signature(value)
            for attr, value in sorted(vars(cls).items())
            if not attr.startswith("_") and inspect.isfunction(value)
        }
    return {
        "version": PLUGIN_API_VERSION,
        "hooks": dict(sorted(hooks.items())),
        "interfaces": methods,
        "data": {name: _fields(cls) for name, cls in DATA.items()},
        "Registry.add": _signature(Registry.add),
    }


def test_the_plugin_api_matches_its_snapshot_or_the_version_was_bumped():
    api = current_api()
    if os.environ.get("ENGINECORE_UPDATE_API_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
        pytest.skip("snapshot recorded")
    recorded = json.loads(SNAPSHOT.read_text())
    if api == recorded:
        return
    changed = sorted(key for key in api if key != "version" and api[key] != recorded.get(key))
    assert recorded["version"] != PLUGIN_API_VERSION, (
        f"the plugin API changed ({', '.join(changed)}) but PLUGIN_API_VERSION is still "
        f"{PLUGIN_API_VERSION}: bump it (major for a breaking change, minor for an "
        "addition), add a line to the change table in docs/plugin_operations.md, then record the "
        "snapshot with ENGINECORE_UPDATE_API_SNAPSHOT=1"
    )
    pytest.fail(
        f"PLUGIN_API_VERSION is {PLUGIN_API_VERSION}: record the snapshot with "
        "ENGINECORE_UPDATE_API_SNAPSHOT=1 once docs/plugin_operations.md describes the change"
    )


def test_the_current_version_has_a_changelog_line():
    major_minor_patch = re.escape(PLUGIN_API_VERSION)
    assert re.search(rf"^\| {major_minor_patch} \| \S", CHANGELOG.read_text(), re.M), (
        f"docs/plugin_operations.md's change table has no line for {PLUGIN_API_VERSION}"
    )


def test_a_changed_hook_is_caught(monkeypatch):
    """The check itself: an added hook argument changes the API."""
    recorded = json.loads(SNAPSHOT.read_text())

    def engine_stopped(reason, extra):  # one argument more than the spec
        """"""

    engine_stopped.enginecore_spec = {}
    monkeypatch.setattr(hookspecs, "engine_stopped", engine_stopped)
    assert current_api()["hooks"] != recorded["hooks"]


def test_every_field_of_the_data_a_plugin_receives_is_documented():
    text = DOCS.read_text()
    section = text[text.index("### Data a plugin receives") :]
    section = section.split("\n## ", 1)[0]  # up to the next section, if one follows
    for name, cls in DATA.items():
        if name == "WorkerSpec":
            continue  # an executor passes it on unread
        missing = [f for f in _fields(cls) if f"`{f}`" not in section]
        assert not missing, f"docs/plugins.md does not describe {name}.{', '.join(missing)}"
    assert "`extra`" in section and "`close()`" in section
