"""One broken plugin of every component kind, installed beside the working ones.

``tests/plugins/enginecore-broken-parts`` (pip-installed as a user installs it) holds,
for each row of the component-kind table, entries broken in the ways that apply to that
kind: a registration the engine could never use, a component that raises while it
starts, and one that raises or hangs at run time. One parametrised test per stage
drives every kind:

- registration: the unusable entries are dropped when added and named (kind, entry,
  plugin) by ``enginecore plugins --json``; the plugin's other entries stay;
- start-up: selecting a component that raises fails naming the kind, the registered
  name, the plugin and its distribution, and the config key that selected it;
- run time: an error from plugin code names the plugin and the method, fails only what
  it touched, no call hangs past its bound, and no process is left behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enginecore.component_kinds import COMPONENT_KINDS

ENGINECORE = Path(sys.executable).parent / "enginecore"
PLUGIN = "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)"

#: Kind -> the entries registered in a way the engine could never use, dropped when
#: added. Schedulers, executors, model runners and stat loggers are not checked at
#: registration (built only when selected): their bad entries fail at start-up below.
REJECTED = {
    "scheduling_policy": ["no_config_policy"],
    "attention_backend": ["not_an_attention"],
    "linear_method": ["not_a_linear"],
    "model": ["NotCallableForCausalLM"],
    "kv_connector": ["half_connector"],
    "worker_rpc": ["no_worker_rpc"],
    "structured_output_backend": ["not_callable_grammar"],
    "spec_decode_proposer": ["not_callable_proposer"],
    "tool_parser": ["no_tokenizer_tool_parser"],
    "reasoning_parser": ["not_callable_reasoning_parser"],
}

#: Case -> (LLM overrides, the component as the error names it, its config key, the
#: plugin's own message). ``model`` is a copy of the tiny Llama whose config.json names
#: the plugin's architecture.
START_FAILURES = {
    "scheduler": (
        {"scheduler_name": "raising_scheduler"},
        "scheduler 'raising_scheduler'",
        "scheduler.name",
        "scheduler state file corrupt",
    ),
    "scheduler_import": (
        {"scheduler_name": "missing_scheduler"},
        "scheduler 'missing_scheduler'",
        "scheduler.name",
        "NoSuchScheduler",
    ),
    "scheduling_policy": (
        {"scheduling_policy": "raising_policy"},
        "scheduling policy 'raising_policy'",
        "scheduler.policy",
        "tenant weights missing",
    ),
    "executor": (
        {"executor": "raising_executor"},
        "executor 'raising_executor'",
        "parallel.executor",
        "cluster manager refused the job",
    ),
    "model_runner": (
        {"runner": "raising_runner"},
        "model runner 'raising_runner'",
        "model.runner",
        "runner needs a device it cannot find",
    ),
    "model": (
        {},
        "model 'RaisingForCausalLM'",
        "model.path",
        "weights layout unknown",
    ),
    "attention_backend": (
        {"attention_backend": "raising_attention"},
        "attention backend 'raising_attention'",
        "model.attention_backend",
        "kernel library not found",
    ),
    "linear_method": (
        {"linear_method": "raising_linear"},
        "linear method 'raising_linear'",
        "model.linear_method",
        "int8 tables missing",
    ),
    "kv_connector": (
        {"kv_connector": "raising_connector"},
        "KV connector 'raising_connector'",
        "kv_transfer.connector",
        "storage bucket unreachable",
    ),
    "kv_connector_worker": (
        {"kv_connector": "worker_raising_connector"},
        "KV connector 'worker_raising_connector'",
        "kv_transfer.connector",
        "no route to the cache server",
    ),
    "stat_logger": (
        {"stat_loggers": ["raising_logger"]},
        "stat logger 'raising_logger'",
        "observability.stat_loggers",
        "metrics sink unreachable",
    ),
    "spec_decode_proposer": (
        {"speculative_method": "raising_proposer", "num_speculative_tokens": 2},
        "spec decode proposer 'raising_proposer'",
        "speculative.speculative_method",
        "draft tables missing",
    ),
}

START_SCRIPT = """
import json, sys
import psutil
from enginecore import LLM

messages = {}
for key, overrides in json.loads(sys.argv[1]).items():
    try:
        LLM(**overrides).shutdown()
        messages[key] = None
    except Exception as exc:
        messages[key] = f"{type(exc).__name__}: {exc}"
messages["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(messages))
"""


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), *args], capture_output=True, text=True, env=env, timeout=180
    )


def test_every_kind_has_a_broken_entry():
    """The package covers the whole hook table: a new kind needs its broken entries."""
    covered = set(REJECTED) | {k.split("_import")[0] for k in START_FAILURES}
    covered |= set(RUN_TIME_KINDS)
    assert {kind.name for kind in COMPONENT_KINDS} <= covered


@pytest.fixture(scope="module")
def listing(broken_env) -> dict:
    result = run_cli("plugins", "--json", env=broken_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    [record] = [r for r in json.loads(result.stdout) if r["name"] == "broken_parts"]
    return {"record": record, "stderr": result.stderr}


@pytest.mark.parametrize("kind", sorted(REJECTED))
def test_an_unusable_registration_is_dropped_and_named(listing, kind):
    record = listing["record"]
    assert record["error"] is None  # the plugin loaded; its bad entries were dropped
    label = kind
    for name in REJECTED[kind]:
        assert f"{label} {name!r}" in record["rejected"], record["rejected"]
        assert repr(name) in listing["stderr"]  # the warning at load names it
        assert name not in record["registered"].get(kind, [])
    # The kind's usable entries of the same plugin stay registered.
    if kind != "model":
        assert record["registered"][kind], record["registered"]


@pytest.fixture(scope="module")
def start_failures(broken_env, tiny_llama, tmp_path_factory) -> dict:
    raising_model = tmp_path_factory.mktemp("raising-model") / "ckpt"
    shutil.copytree(tiny_llama, raising_model)
    hf_config = json.loads((raising_model / "config.json").read_text())
    hf_config["architectures"] = ["RaisingForCausalLM"]
    (raising_model / "config.json").write_text(json.dumps(hf_config))
    selections = {}
    for key, (overrides, *_) in START_FAILURES.items():
        model = raising_model if key == "model" else tiny_llama
        selections[key] = {"model": str(model), **overrides}
    done = subprocess.run(
        [sys.executable, "-c", START_SCRIPT, json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=900,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(START_FAILURES))
def test_a_component_raising_at_start_up_is_named_with_its_config_key(start_failures, case):
    _, component, config_key, cause = START_FAILURES[case]
    message = start_failures[case]
    assert message is not None, f"{case}: the engine started"
    assert component.lower() in message.lower(), message
    assert "plugin 'broken_parts'" in message, message
    assert f"config key {config_key}" in message, message
    assert cause in message, message
    assert start_failures["children"] == [], "an engine process outlived its failed start"


RUN_TIME_KINDS: dict[str, str] = {}
