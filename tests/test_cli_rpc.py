"""``enginecore rpc`` against a real ``enginecore serve``, started by the kit's fixture.

``enginecore_server`` comes from ``enginecore.testing`` (loaded through its ``pytest11``
entry point): a live server with ``/collective_rpc`` enabled, on the kit's tiny model.
"""

from __future__ import annotations

import json
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


def test_trace_next_steps_through_the_server(enginecore_server, tmp_path):
    import httpx

    target = tmp_path / "trace-{rank}.jsonl"
    result = rpc(
        "trace_next_steps",
        "2",
        "--kwargs",
        json.dumps({"path": str(target)}),
        "--url",
        enginecore_server.url,
    )
    assert result.returncode == 0, result.stderr
    [path] = json.loads(result.stdout)
    assert path == str(tmp_path / "trace-0.jsonl")
    response = httpx.post(
        f"{enginecore_server.url}/v1/completions",
        json={"model": enginecore_server.model, "prompt": "hi there", "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len(lines) == 2
    assert (
        lines[0]["scheduler_output"]["scheduled_new_reqs"][0]["sampling_params"]["max_tokens"] == 4
    )


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
