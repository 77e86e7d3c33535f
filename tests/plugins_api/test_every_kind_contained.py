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


RUN_TIME_SCRIPT = """
import json, sys, time
import psutil
from enginecore import LLM, SamplingParams, StructuredOutputParams
from enginecore_broken_parts import plugin

model = sys.argv[1]
report = {}
greedy = SamplingParams(max_tokens=4, temperature=0.0)

# One engine shares the kinds that fail per call: stat loggers, a worker RPC, a grammar.
loggers = ["counting_logger", "record_raising_logger", "record_hanging_logger"]
with LLM(model=model, stat_loggers=loggers, frontend_plugin_timeout=1,
         structured_output_backend="raising_grammar") as llm:
    started = time.monotonic()
    first = llm.generate([[5, 6, 7], [8, 9]], greedy, use_tqdm=False)
    recorded = len(plugin.RECORDED)
    later = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    report["stat_logger"] = {
        "served": [len(o.outputs[0].token_ids) for o in first + later],
        "seconds": time.monotonic() - started,
        "disabled": sorted(llm.stat_loggers.names[i] for i in llm.stat_loggers.disabled),
        "kept_recording": len(plugin.RECORDED) > recorded > 0,
    }
    try:
        llm.collective_rpc("raising_rpc")
        report["worker_rpc"] = None
    except Exception as exc:
        report["worker_rpc"] = f"{type(exc).__name__}: {exc}"
    constrained = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(
        choice=["yes", "no"]))
    outs = llm.generate([[5, 6, 7], [8, 9]], [constrained, greedy], use_tqdm=False)
    report["structured_output_backend"] = outs[0].error
    report["grammar_other_request"] = len(outs[1].outputs[0].token_ids)

with LLM(model=model, kv_connector="raising_load_connector") as llm:
    outs = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)
    report["kv_connector"] = outs[0].error
report["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(report))
"""

#: Kind -> what its run-time error must name besides the plugin (the method, the
#: component and its config key).
RUN_TIME_KINDS = {
    "stat_logger": ["RecordRaisingStatLogger.record", "RecordHangingStatLogger.record"],
    "worker_rpc": ["raising_rpc", "profiler not attached"],
    "structured_output_backend": [
        "raising_grammar",
        "structured_output.backend",
        "grammar compiler not installed",
    ],
    "kv_connector": [
        "RaisingLoadWorker.start_load_kv",
        "KV connector 'raising_load_connector'",
        "config key kv_transfer.connector",
        "remote cache returned a short read",
    ],
}


@pytest.fixture(scope="module")
def run_time_failures(broken_env, tiny_llama) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RUN_TIME_SCRIPT, str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=600,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict = json.loads(done.stdout.strip().splitlines()[-1])
    report["stderr"] = done.stderr
    return report


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(RUN_TIME_KINDS))
def test_a_component_failing_at_run_time_is_named_and_contained(run_time_failures, kind):
    assert run_time_failures["children"] == [], "an engine process outlived its LLM"
    if kind == "stat_logger":
        # The broken loggers are disabled and named once each; the calls were served
        # within the frontend's limit and the working logger kept recording.
        stats = run_time_failures["stat_logger"]
        assert stats["served"] == [4, 4, 4], stats
        assert stats["disabled"] == ["record_hanging_logger", "record_raising_logger"], stats
        assert stats["kept_recording"], stats
        assert stats["seconds"] < 60, stats
        lines = run_time_failures["stderr"].splitlines()
        for method in RUN_TIME_KINDS[kind]:
            named = [line for line in lines if f"in {method};" in line]
            assert len(named) == 1, named or run_time_failures["stderr"][-3000:]
            assert f"from {PLUGIN}" in named[0] and "it is disabled" in named[0], named
        assert (
            "did not return within 1 s (config key engine.frontend_plugin_timeout)"
            in (run_time_failures["stderr"])
        )
        return
    message = run_time_failures[kind]
    assert message is not None, f"{kind}: nothing failed"
    assert "plugin 'broken_parts'" in message, message
    for needed in RUN_TIME_KINDS[kind]:
        assert needed in message, message
    if kind == "structured_output_backend":  # the unconstrained request was served
        assert run_time_failures["grammar_other_request"] == 4


HANG_SCRIPT = """
import json, sys, threading, time
import psutil
from enginecore import LLM, SamplingParams

report = {}
for key, overrides in json.loads(sys.argv[1]).items():
    started = time.monotonic()
    try:
        llm = LLM(multiprocessing=False, execute_timeout=2, ready_timeout=60, **overrides)
        try:
            llm.generate([[5, 6, 7, 5, 6]], SamplingParams(max_tokens=4), use_tqdm=False)
            report[key] = {"error": None}
        finally:
            llm.shutdown()
    except Exception as exc:
        report[key] = {"error": f"{type(exc).__name__}: {exc}"}
    report[key]["seconds"] = time.monotonic() - started
threads = [t for t in threading.enumerate() if t is not threading.main_thread()]
report["non_daemon_threads"] = [t.name for t in threads if not t.daemon]
report["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(report))
"""

#: Case -> (LLM overrides, the method the error must name, the component and its config
#: key). The engine runs in-process with ``engine.execute_timeout`` 2 s; ``model`` is a
#: copy of the tiny Llama whose config.json names the plugin's hanging architecture.
HANG_CASES = {
    "scheduler": (
        {"scheduler_name": "hanging_scheduler"},
        "HangingScheduler.schedule",
        "scheduler 'hanging_scheduler', config key scheduler.name",
    ),
    "executor": (
        {"executor": "hanging_executor"},
        "HangingExecutor.execute_model",
        "executor 'hanging_executor', config key parallel.executor",
    ),
    "model_runner": (
        {"runner": "hanging_runner"},
        "HangingRunner.execute_model",
        "model runner 'hanging_runner', config key model.runner",
    ),
    "model": (
        {},
        "HangingForCausalLM.forward",
        "model 'HangingForCausalLM', the checkpoint's architecture, config key model.path",
    ),
    "spec_decode_proposer": (
        {"speculative_method": "hanging_proposer", "num_speculative_tokens": 2},
        "HangingProposer.propose",
        "spec decode proposer 'hanging_proposer', config key speculative.speculative_method",
    ),
}


@pytest.fixture(scope="module")
def hangs(broken_env, tiny_llama, tmp_path_factory) -> dict:
    hanging_model = tmp_path_factory.mktemp("hanging-model") / "ckpt"
    shutil.copytree(tiny_llama, hanging_model)
    hf_config = json.loads((hanging_model / "config.json").read_text())
    hf_config["architectures"] = ["HangingForCausalLM"]
    (hanging_model / "config.json").write_text(json.dumps(hf_config))
    selections = {
        key: {"model": str(hanging_model if key == "model" else tiny_llama), **overrides}
        for key, (overrides, *_) in HANG_CASES.items()
    }
    done = subprocess.run(
        [sys.executable, "-c", HANG_SCRIPT, json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=600,  # each hang is bounded by its 2 s watchdog: far less than this
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the process exits, hung threads or not
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(HANG_CASES))
def test_a_component_hanging_at_run_time_is_bounded_and_named(hangs, case):
    """A step stuck in the component fails the request past ``engine.execute_timeout``
    naming the plugin, the method, the component and its config key; nothing that would
    hold the process (a child, a non-daemon thread) is left."""
    _, method, component = HANG_CASES[case]
    error = hangs[case]["error"]
    assert error is not None, f"{case}: the request was served"
    assert error.startswith("EngineDeadError: the engine core is stuck: "), error
    assert "a step took longer than 2 s (engine.execute_timeout)" in error, error
    assert f"in {PLUGIN}, in {method} ({component}" in error, error
    assert hangs[case]["seconds"] < 60, hangs[case]
    assert hangs["non_daemon_threads"] == [] and hangs["children"] == [], hangs


WRONG_SHAPES_SCRIPT = """
import json, sys
from enginecore import LLM, SamplingParams, StructuredOutputParams

report = {}
greedy = SamplingParams(max_tokens=4, temperature=0.0)
constrained = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(
    choice=["yes", "no"]))
for key, overrides in json.loads(sys.argv[2]).items():
    with LLM(model=sys.argv[1], multiprocessing=False, **overrides) as llm:
        params = [constrained, greedy] if "structured_output_backend" in overrides else greedy
        try:
            outs = llm.generate([[5, 6, 7, 5, 6], [8, 9]], params, use_tqdm=False)
            report[key] = {"errors": [o.error for o in outs],
                           "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        except Exception as exc:
            report[key] = {"raised": f"{type(exc).__name__}: {exc}"}
print(json.dumps(report))
"""

#: Case -> (LLM overrides, the method the error must name, what it says was wrong).
WRONG_SHAPES = {
    "long_drafts": (
        {"speculative_method": "long_drafts_proposer", "num_speculative_tokens": 2},
        "LongDraftsProposer.propose",
        "4 drafts where at most 2 were asked for",
    ),
    "float_drafts": (
        {"speculative_method": "float_drafts_proposer", "num_speculative_tokens": 2},
        "FloatDraftsProposer.propose",
        "0.5, which is not a token id",
    ),
    "grammar_bitmask": (
        {"structured_output_backend": "no_token_grammar"},
        "NoTokenGrammar.fill_bitmask",
        "allows no token",
    ),
}


@pytest.fixture(scope="module")
def wrong_shapes(broken_env, tiny_llama) -> dict:
    selections = {key: overrides for key, (overrides, *_) in WRONG_SHAPES.items()}
    done = subprocess.run(
        [sys.executable, "-c", WRONG_SHAPES_SCRIPT, str(tiny_llama), json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=600,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WRONG_SHAPES))
def test_a_component_returning_the_wrong_shape_is_named(wrong_shapes, case):
    """Drafts of the wrong length or type, a grammar row that allows nothing: a named
    error, not silently wrong tokens or a bare exception."""
    _, method, wrong = WRONG_SHAPES[case]
    outcome = wrong_shapes[case]
    message = outcome.get("raised") or outcome["errors"][0]
    assert message is not None, f"{case}: served as if nothing were wrong: {outcome}"
    assert f"[raised by {PLUGIN}, in {method}]" in message, message
    assert wrong in message, message
    if case == "grammar_bitmask":  # the unconstrained request is served
        assert outcome["errors"][1] is None and len(outcome["tokens"][1]) == 4, outcome
