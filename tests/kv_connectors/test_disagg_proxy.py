"""``enginecore disagg-proxy``'s own error handling, against unreachable instances (the
full prefill -> decode path is in test_disagg_serving.py, marked slow)."""

from __future__ import annotations

import subprocess
import sys

from fastapi.testclient import TestClient

from enginecore.server.disagg_proxy import build_app
from enginecore.testing.kv_connector_contract import free_port


def _client() -> tuple[TestClient, str]:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return TestClient(build_app([dead], [dead], timeout=5)), dead


def test_unreachable_prefill_instance_is_a_502_naming_it():
    client, dead = _client()
    with client:
        answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 502
    assert f"prefill instance {dead} unreachable" in answer.json()["error"]["message"]


def test_bad_bodies_are_400():
    client, _ = _client()
    with client:
        assert client.post("/v1/completions", content=b"{nope").status_code == 400
        answer = client.post("/v1/chat/completions", json=[1, 2])
    assert answer.status_code == 400
    assert "JSON object" in answer.json()["error"]["message"]


def test_health_reports_the_unhealthy_instance():
    client, dead = _client()
    with client:
        answer = client.get("/health")
    assert answer.status_code == 503 and dead in answer.json()["error"]["message"]


def test_cli_requires_both_kinds_of_instance():
    result = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "disagg-proxy", "--prefill", "http://x"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--decode" in result.stderr


def test_several_prompts_or_n_go_straight_to_decode():
    """One handoff covers one sequence: a batch of prompts (or n > 1) is not prefilled
    remotely (its blocks would wait for a decode instance that never asks)."""
    prefill_dead = f"http://127.0.0.1:{free_port()}"
    decode_dead = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_app([prefill_dead], [decode_dead], timeout=5)) as client:
        for body in ({"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}):
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 502
            assert f"decode instance {decode_dead}" in answer.json()["error"]["message"]
        answer = client.post("/v1/completions", json={"prompt": [1, 2, 3]})  # token ids
        assert f"prefill instance {prefill_dead}" in answer.json()["error"]["message"]
