"""``enginecore rpc`` against a real ``enginecore serve``, started by the kit's fixture.

``enginecore_server`` comes from ``enginecore.testing`` (loaded through its ``pytest11``
entry point): a live server with ``/collective_rpc`` enabled, on the kit's tiny model.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

ENGINECORE = Path(sys.executable).parent / "enginecore"


def rpc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ENGINECORE), "rpc", *args], capture_output=True, text=True, timeout=120
    )


def test_memory_snapshot_prints_json_per_rank(enginecore_server):
    result = rpc("memory_snapshot", "--url", enginecore_server.url)
    assert result.returncode == 0, result.stderr
    [snapshot] = json.loads(result.stdout)
    assert snapshot["rank"] == 0
    assert snapshot["kv_cache_num_blocks"] == 256  # the fixture's num_blocks_override
    assert snapshot["kv_cache_bytes"] > 0 and snapshot["host"]["rss_bytes"] > 0


def test_model_summary_counts_every_checkpoint_parameter(enginecore_server, enginecore_model):
    result = rpc("model_summary", "--url", enginecore_server.url)
    assert result.returncode == 0, result.stderr
    [summary] = json.loads(result.stdout)
    with safe_open(str(enginecore_model / "model.safetensors"), "pt") as f:
        expected = 0
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = f.get_slice(name).get_shape()
            count = 1
            for dim in shape:
                count *= dim
            expected += count
    assert summary["num_parameters"] == expected


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces") / "fixed-at-start"


@pytest.fixture(scope="module")
def enginecore_config_overrides(trace_dir):
    return {"trace_dir": str(trace_dir)}


def test_trace_next_steps_through_the_server(enginecore_server, trace_dir):
    import httpx

    result = rpc("trace_next_steps", "2", "--url", enginecore_server.url)
    assert result.returncode == 0, result.stderr
    [path] = json.loads(result.stdout)
    assert Path(path).parent == trace_dir
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    assert stat.S_IMODE(trace_dir.stat().st_mode) == 0o700
    response = httpx.post(
        f"{enginecore_server.url}/v1/completions",
        json={"model": enginecore_server.model, "prompt": "hi there", "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len(lines) == 2
    [new] = lines[0]["scheduler_output"]["scheduled_new_reqs"]
    assert new["sampling_params"]["max_tokens"] == 4
    # The operator did not ask for prompt contents: only their size is kept.
    assert new["prompt_token_ids"] == {"redacted_count": lines[0]["num_scheduled_tokens"]}


def test_trace_next_steps_takes_no_path_from_the_network(enginecore_server, tmp_path):
    import httpx

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    for body in (
        {"method": "trace_next_steps", "args": [2, str(victim)]},
        {"method": "trace_next_steps", "args": [2], "kwargs": {"path": str(tmp_path / "new/x")}},
    ):
        answer = httpx.post(f"{enginecore_server.url}/collective_rpc", json=body, timeout=60)
        assert answer.status_code >= 400, answer.text
        assert "takes no path" in answer.text, answer.text
    assert victim.read_text() == "precious"
    assert not (tmp_path / "new").exists()


def test_trace_files_are_bounded_in_number(enginecore_server, trace_dir):
    import httpx

    from enginecore_executors.step_trace import MAX_TRACE_FILES

    # The endpoint the command calls (the command itself is the other tests' subject).
    body = {"method": "trace_next_steps", "args": [1]}
    for _ in range(MAX_TRACE_FILES + 3):
        answer = httpx.post(f"{enginecore_server.url}/collective_rpc", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
    assert len(list(trace_dir.glob("enginecore-trace-*.jsonl"))) == MAX_TRACE_FILES


def test_errors_say_what_to_do(enginecore_server):
    unknown = rpc("no_such_rpc", "--url", enginecore_server.url)
    assert unknown.returncode == 2
    assert "no_such_rpc" in unknown.stderr and "memory_snapshot" in unknown.stderr
    # A URL without the endpoint (as a server without --enable-collective-rpc-endpoint).
    missing = rpc("memory_snapshot", "--url", f"{enginecore_server.url}/elsewhere")
    assert missing.returncode == 2
    assert "--enable-collective-rpc-endpoint" in missing.stderr
    bad_json = rpc("trace_next_steps", "{oops", "--url", enginecore_server.url)
    assert bad_json.returncode == 2 and "must be JSON" in bad_json.stderr
    nobody = rpc("memory_snapshot", "--url", "http://127.0.0.1:9")
    assert nobody.returncode == 2 and "cannot reach an enginecore server" in nobody.stderr


@pytest.mark.parametrize("method", ["shutdown", "load_model", "initialize_cache", "get_pid"])
def test_only_registered_rpcs_are_callable_from_outside(enginecore_server, method):
    refused = rpc(method, "--url", enginecore_server.url)
    assert refused.returncode == 2
    assert "not a registered worker RPC" in refused.stderr and "memory_snapshot" in refused.stderr
    # The engine is untouched: it still generates.
    import httpx

    response = httpx.post(
        f"{enginecore_server.url}/v1/completions",
        json={"model": enginecore_server.model, "prompt": "still here", "max_tokens": 2},
        timeout=60,
    )
    assert response.status_code == 200, response.text


def test_trace_next_steps_is_bounded(enginecore_server):
    result = rpc("trace_next_steps", "1000000", "--url", enginecore_server.url)
    assert result.returncode == 2 and "at most 1000 steps" in result.stderr
