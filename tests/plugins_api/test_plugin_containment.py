"""A broken plugin is contained and named: ``tests/plugins/enginecore-broken-parts``,
pip-installed as a user installs it, holds one broken component of each kind beside a
working worker RPC.

- A registration that is not what its kind needs (a plain class as a linear method) is
  dropped when it is added; ``enginecore plugins`` lists it as rejected, ``--check``
  fails naming the plugin, and an engine with the default config serves as if it were
  not installed (the plugin's valid entries still work).
- A component that raises while it starts is reported with its kind, registered name,
  plugin and the config key that selected it, not as the executor's failure.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from enginecore.cli_rpc import ANSWER_GRACE, DEFAULT_TIMEOUT, RPCCallError, call_rpc
from enginecore.engine.exit_deadline import STOP_GRACE
from enginecore.layers.preparation_watch import REPORT_AFTER
from enginecore.plugins import make_plugin_manager
from tests.helpers.serve_process import serve, stop

ENGINECORE = Path(sys.executable).parent / "enginecore"


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), *args], capture_output=True, text=True, env=env, timeout=180
    )


def test_a_bad_registration_is_dropped_and_named_by_the_listing(broken_env):
    result = run_cli("plugins", env=broken_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    block = result.stdout[result.stdout.index("broken_parts  (") :]
    # The valid entries are listed, the bad one is not among them but named as rejected.
    assert "    worker_rpc: hang, ping, raising_rpc\n" in block
    linear_line = next(line for line in block.splitlines() if "linear_method:" in line)
    assert "not_a_linear" not in linear_line and "raising_linear" in linear_line
    assert "    rejected: linear_method 'not_a_linear': " in block
    assert "not a subclass of enginecore.interfaces.LinearMethod" in block
    # The warning at load names the plugin, its distribution and the entry.
    assert "'broken_parts' (distribution enginecore-broken-parts 0.1.0)" in result.stderr
    assert "'not_a_linear'" in result.stderr


def test_check_fails_naming_the_plugin_and_the_entry(broken_env):
    result = run_cli("plugins", "--check", env=broken_env)
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    findings = result.stderr.splitlines()
    [finding] = [line for line in findings if "not_a_linear" in line and line.startswith("error:")]
    assert finding.startswith("error: plugin 'broken_parts' (distribution enginecore-broken")
    assert "LinearMethod" in finding
    listed = json.loads(run_cli("plugins", "--json", env=broken_env).stdout)
    [record] = [r for r in listed if r["name"] == "broken_parts"]
    assert record["error"] is None  # the plugin loaded; one entry was dropped
    assert "linear_method 'not_a_linear'" in record["rejected"]


DEFAULT_ENGINE = """
import json, sys
from enginecore import LLM, SamplingParams

with LLM(model=sys.argv[1]) as llm:
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    print(json.dumps({"tokens": out[0].outputs[0].token_ids, "ping": llm.collective_rpc("ping")}))
"""


def test_the_default_engine_serves_beside_the_broken_plugin(broken_env, tiny_llama):
    done = subprocess.run(
        [sys.executable, "-c", DEFAULT_ENGINE, str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=300,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4 and result["ping"] == ["pong"]


START_FAILURES = """
import json, sys
from enginecore import LLM

messages = {}
for key, value in json.loads(sys.argv[2]).items():
    try:
        LLM(model=sys.argv[1], **{key: value}).shutdown()
        messages[key] = None
    except Exception as exc:
        messages[key] = f"{type(exc).__name__}: {exc}"
print(json.dumps(messages))
"""


@pytest.mark.slow
def test_start_up_failures_name_the_component_plugin_and_key(broken_env, tiny_llama):
    selections = {
        "attention_backend": "raising_attention",
        "linear_method": "raising_linear",
        "kv_connector": "raising_connector",
    }
    done = subprocess.run(
        [sys.executable, "-c", START_FAILURES, str(tiny_llama), json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=600,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {
        "attention_backend": ("attention backend 'raising_attention'", "model.attention_backend"),
        "linear_method": ("linear method 'raising_linear'", "model.linear_method"),
        "kv_connector": ("KV connector 'raising_connector'", "kv_transfer.connector"),
    }
    for key, (component, config_key) in expected.items():
        message = messages[key]
        assert message is not None, key
        assert component.lower() in message.lower(), message
        assert "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)" in message
        assert f"config key {config_key}" in message, message
        assert "executor 'uni'" not in message, message
    assert "kernel library not found" in messages["attention_backend"]
    assert "int8 tables missing" in messages["linear_method"]
    assert "storage bucket unreachable" in messages["kv_connector"]


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_a_hung_worker_rpc_is_abandoned_and_the_server_keeps_serving(
    broken_env, tiny_llama, tmp_path
):
    """``enginecore rpc hang`` fails naming the RPC; the workers go on serving: the next
    completion answers, /health stays 200 and another RPC still works."""
    proc, url = serve(
        tiny_llama, tmp_path / "serve.log", "--enable-collective-rpc-endpoint", env=broken_env
    )
    try:
        hung = run_cli("rpc", "hang", "--timeout", "2", "--url", url, env=broken_env)
        assert hung.returncode == 2  # the CLI's exit status for an enginecore error
        # The worker is not held by the abandoned call: the next completion answers.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        done = client.completions.create(
            model=str(tiny_llama), prompt="hello", max_tokens=3, temperature=0.0
        )
        assert done.choices[0].finish_reason == "length"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        pong = run_cli("rpc", "ping", "--url", url, env=broken_env)
        assert pong.returncode == 0, pong.stderr
        assert json.loads(pong.stdout) == ["pong"]
        assert "Traceback" not in hung.stdout + hung.stderr
        assert "worker RPC 'hang' did not return within 2 s" in hung.stderr, hung.stderr
    finally:
        stop(proc)


def test_rpc_cli_default_timeout_and_a_silent_server_are_clear_errors(broken_env):
    """Without --timeout the RPC gets a default limit; a server that never answers is a
    one-line error, not a traceback."""
    help_text = run_cli("rpc", "--help", env=broken_env).stdout
    assert f"(default {DEFAULT_TIMEOUT:g})" in " ".join(help_text.split())
    assert "Worker method" not in help_text  # only registered RPCs can be called
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RPCCallError, match=r"did not answer within 0\.5 s"):
            call_rpc(url, "ping", timeout=0.5 - ANSWER_GRACE)


HANGING_FRONTEND = """
import sys
from enginecore import LLM, SamplingParams

llm = LLM(model=sys.argv[1], scheduling_policy="hanging_sort")
print("generating", flush=True)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
"""


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_no_engine_process_outlives_a_killed_frontend_stuck_in_a_plugin(broken_env, tiny_llama):
    """The engine loop is stuck in a policy's sort_key; the frontend is SIGKILLed; the
    engine process (and any worker) is gone within the stop grace."""
    frontend = subprocess.Popen(
        [sys.executable, "-c", HANGING_FRONTEND, str(tiny_llama)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=broken_env,
    )
    try:
        assert frontend.stdout is not None
        assert frontend.stdout.readline().strip() == "generating"
        children = psutil.Process(frontend.pid).children(recursive=True)
        assert children, "the engine runs in its own process"
        time.sleep(2)  # the engine loop is now inside sort_key
        assert all(c.is_running() for c in children)
        frontend.send_signal(signal.SIGKILL)
        frontend.wait(10)
        _gone, alive = psutil.wait_procs(children, timeout=STOP_GRACE + 20)
        assert not alive, f"left behind: {[(p.pid, p.cmdline()[:3]) for p in alive]}"
    finally:
        frontend.kill()
        for child in psutil.Process().children(recursive=True):
            child.kill()


def test_disabling_an_unknown_plugin_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="enginecore.plugins"):
        make_plugin_manager(disabled=["builtin_shedulers", "builtin_models"])
    [warning] = [r.getMessage() for r in caplog.records if "disables nothing" in r.getMessage()]
    assert "'builtin_shedulers'" in warning and "Did you mean 'builtin_schedulers'" in warning


RUN_TIME_FAILURES = """
import json, sys
from enginecore import LLM, SamplingParams

messages = {}
for key, overrides in json.loads(sys.argv[2]).items():
    try:
        with LLM(model=sys.argv[1], **overrides) as llm:
            prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=4))
            # A request the engine could not take fails alone, with the reason.
            messages[key] = next((o.error for o in outs if o.error), None)
    except Exception as exc:
        messages[key] = f"{type(exc).__name__}: {exc}"
print(json.dumps(messages))
"""


@pytest.mark.slow
def test_wrong_outputs_from_plugin_code_name_the_plugin_and_method(broken_env, tiny_llama):
    """A backend or linear method returning the wrong shape, a policy whose sort keys
    cannot be ordered: each error names the plugin and the method at fault."""
    selections = {
        "attention_backend": {"attention_backend": "wrong_shape_attention"},
        "linear_method": {"linear_method": "wrong_shape_linear"},
        # One running request at a time: the others wait, so their keys are compared.
        "scheduling_policy": {"scheduling_policy": "unorderable", "max_num_seqs": 1},
    }
    done = subprocess.run(
        [sys.executable, "-c", RUN_TIME_FAILURES, str(tiny_llama), json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=600,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    plugin = "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)"
    expected = {
        "attention_backend": "WrongShapeAttention.forward",
        "linear_method": "WrongShapeLinear.apply",
        "scheduling_policy": "UnorderablePolicy.sort_key",
    }
    for key, method in expected.items():
        message = messages[key]
        assert message is not None, key
        assert f"[raised by {plugin}, in {method}]" in message, message
    assert "must return the query's shape" in messages["attention_backend"]
    assert "cannot be ordered" in messages["scheduling_policy"]


HANGING_PREPARATION = """
import sys
from enginecore import LLM

LLM(model=sys.argv[1], linear_method="hanging_prepare_linear")
"""


@pytest.mark.slow
def test_a_linear_method_hanging_in_weight_preparation_is_reported_while_it_hangs(
    broken_env, tiny_llama
):
    """Reported once a layer has taken REPORT_AFTER seconds, naming the method, its
    plugin and the layer, while start-up still waits (engine.ready_timeout, 600 s by
    default, has not given up: the frontend is still running when the report arrives)."""
    frontend = subprocess.Popen(
        [sys.executable, "-c", HANGING_PREPARATION, str(tiny_llama)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=broken_env,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        assert frontend.stderr is not None
        # Event-driven: read the log as it comes until the report (or the end of it).
        for line in frontend.stderr:
            seen.append(line)
            if "has been preparing layer" in line:
                break
        report = seen[-1] if seen else ""
        assert "has been preparing layer" in report, "".join(seen)[-3000:]
        assert frontend.poll() is None, "start-up gave up before the report"
        assert "linear method HangingPrepareLinear from plugin 'broken_parts'" in report
        assert f"for {REPORT_AFTER:.0f} s" in report and "model.layers.0." in report, report
    finally:
        try:
            children = psutil.Process(frontend.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        os.killpg(frontend.pid, signal.SIGKILL)
        frontend.wait(30)
        for child in children:
            if child.is_running():
                child.kill()


IN_PROCESS_HANGS = """
import json, sys, threading
import psutil
from enginecore import LLM, SamplingParams

report = {}
for key, overrides in json.loads(sys.argv[2]).items():
    entry = report[key] = {}
    try:
        llm = LLM(model=sys.argv[1], multiprocessing=False, execute_timeout=3, rpc_timeout=2,
                  **overrides)
    except Exception as exc:
        entry["first"] = f"{type(exc).__name__}: {exc}"
        continue
    try:
        if key == "rpc":
            llm.collective_rpc("hang")
        else:
            llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4), use_tqdm=False)
    except Exception as exc:
        entry["first"] = f"{type(exc).__name__}: {exc}"
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        entry["later"] = "served"
    except Exception as exc:
        entry["later"] = f"{type(exc).__name__}: {exc}"
    llm.shutdown()
threads = [t for t in threading.enumerate() if t is not threading.main_thread()]
report["non_daemon_threads"] = [t.name for t in threads if not t.daemon]
report["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(report))
"""

#: What hangs under ``multiprocessing=False``, and the method the error must name.
IN_PROCESS_HANG_CASES = {
    "sort_key": ({"scheduling_policy": "hanging_sort"}, "HangingPolicy.sort_key"),
    "rpc": ({}, None),
}
SLOW_IN_PROCESS_HANG_CASES = {
    "attention": ({"attention_backend": "hanging_attention"}, "HangingAttention.forward"),
    "kv_load": (
        {"kv_transfer": {"connector": "hanging_load_connector"}},
        "HangingLoadWorker.start_load_kv",
    ),
    "prepare": (
        {"linear_method": "hanging_prepare_linear", "ready_timeout": 5},
        "HangingPrepareLinear.process_weights_after_loading",
    ),
}


#: What a hang names beside the method, where the method's class is the registered one.
HUNG_COMPONENTS = {
    "sort_key": "scheduling policy 'hanging_sort', config key scheduler.policy",
    "attention": "attention backend 'hanging_attention', config key model.attention_backend",
    "prepare": "linear method 'hanging_prepare_linear', config key model.linear_method",
    "kv_load": "the worker half of a KV connector, config key kv_transfer.connector",
}


def _run_in_process_hangs(broken_env, tiny_llama, cases) -> dict:
    selections = {key: overrides for key, (overrides, _) in cases.items()}
    done = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_HANGS, str(tiny_llama), json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=300,  # each hang is bounded by its watchdog: far less than this
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the process exits, hung threads or not
    report: dict = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["non_daemon_threads"] == [] and report["children"] == [], report
    plugin = "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)"
    for key, (_, method) in cases.items():
        if method is None:
            continue
        first = report[key]["first"]
        assert first.startswith("EngineDeadError: the engine core is stuck: "), first
        assert f"in {plugin}, in {method}" in first, first
        if key in HUNG_COMPONENTS:  # the component and the config key that selected it
            assert f"in {method} ({HUNG_COMPONENTS[key]})." in first, first
        if key == "prepare":
            assert "not ready within 5 s (engine.ready_timeout)" in first, first
        else:
            assert "took longer than 3 s (engine.execute_timeout)" in first, first
            assert report[key]["later"] == first  # later calls: the same death, named
    return report


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_in_process_engine_hangs_are_bounded_and_named(broken_env, tiny_llama):
    """``LLM(multiprocessing=False)``: a policy hanging in ``sort_key`` fails the call
    after ``engine.execute_timeout`` naming the plugin and the method, and every later
    call says the engine died of it; a hung worker RPC fails after its limit naming the
    RPC and the engine goes on serving. No thread that would hold the process is left."""
    report = _run_in_process_hangs(broken_env, tiny_llama, IN_PROCESS_HANG_CASES)
    rpc = report["rpc"]
    assert "worker RPC 'hang' did not return within 2 s" in rpc["first"], rpc
    assert rpc["later"] == "served"


@pytest.mark.slow
def test_in_process_hangs_in_the_worker_are_bounded_and_named(broken_env, tiny_llama):
    """As above, for code the ``uni`` executor's worker thread runs: an attention
    forward, a KV connector's load, and a linear method's weight preparation (bounded by
    ``engine.ready_timeout``)."""
    _run_in_process_hangs(broken_env, tiny_llama, SLOW_IN_PROCESS_HANG_CASES)


ENGINE_PROCESS_HANGS = """
import json, sys, time
import psutil
from enginecore import LLM, SamplingParams

report = {}
for key, overrides in json.loads(sys.argv[2]).items():
    llm = LLM(model=sys.argv[1], execute_timeout=3, **overrides)
    try:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4), use_tqdm=False)
        report[key] = "served"
    except Exception as exc:
        report[key] = f"{type(exc).__name__}: {exc}"
    llm.shutdown()
time.sleep(1)
report["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_engine_process_hangs_are_bounded_and_named(broken_env, tiny_llama):
    """The engine in its own process (the default) with the ``uni`` executor: a step
    stuck in a policy's ``sort_key`` or an attention forward fails the ``LLM`` call past
    ``engine.execute_timeout`` (plus the step watchdog's grace) naming the plugin and the
    method, and the engine process exits."""
    cases = {
        "sort_key": ({"scheduling_policy": "hanging_sort"}, "HangingPolicy.sort_key"),
        "attention": ({"attention_backend": "hanging_attention"}, "HangingAttention.forward"),
    }
    selections = {key: overrides for key, (overrides, _) in cases.items()}
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS_HANGS, str(tiny_llama), json.dumps(selections)],
        capture_output=True,
        text=True,
        timeout=300,
        env=broken_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["children"] == [], report
    plugin = "plugin 'broken_parts' (distribution enginecore-broken-parts 0.1.0)"
    for key, (_, method) in cases.items():
        message = report[key]
        assert message.startswith("EngineDeadError: the engine core died: "), message
        assert "a step took longer than 3 s (engine.execute_timeout)" in message, message
        assert f"in {plugin}, in {method} ({HUNG_COMPONENTS[key]})" in message, message
