"""The HTTP app in-process, around a stand-in engine: behaviour that needs no model."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from enginecore import make_config
from enginecore.server.app import build_app
from enginecore.server.launch import server_config
from tests.helpers.dead_engine import DeadEngine


@pytest.fixture
def config(tmp_path):
    # TestClient sends "Host: testserver".
    return make_config(model=str(tmp_path), stat_loggers=[], allowed_hosts=["testserver"])


def test_health_is_503_once_the_engine_is_dead(config):
    with TestClient(build_app(config, DeadEngine())) as client:
        response = client.get("/health")
        assert response.status_code == 503
        assert "worker 0 exited" in response.json()["error"]["message"]


def test_requests_to_a_dead_engine_are_503_not_500(config):
    class Tok:
        def __len__(self) -> int:
            return 100

        def encode(self, text: str) -> list[int]:
            return [1] * len(text)

    engine = DeadEngine()
    engine.tokenizer = Tok()
    with TestClient(build_app(config, engine)) as client:
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"


def test_api_key_from_the_environment_and_public_paths(config, monkeypatch):
    monkeypatch.setenv("ENGINECORE_API_KEY", "k1")
    assert server_config(config).server.api_key == "k1"
    with TestClient(build_app(config, DeadEngine())) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/version").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.post("/pause").status_code == 401
        ok = client.get("/version", headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200


def test_prometheus_is_always_among_the_server_stat_loggers(config):
    assert server_config(config).observability.stat_loggers == ["prometheus"]
    both = config.replace(stat_loggers=["logging", "prometheus"])
    assert server_config(both).observability.stat_loggers == ["logging", "prometheus"]


def test_collective_rpc_route_only_when_enabled(config):
    with TestClient(build_app(config, DeadEngine())) as client:
        assert client.post("/collective_rpc", json={"method": "x"}).status_code == 404
    enabled = config.replace(enable_collective_rpc_endpoint=True)
    with TestClient(build_app(enabled, DeadEngine())) as client:
        response = client.post("/collective_rpc", json={"method": "os.system('x')"})
        assert response.status_code == 400  # a plain name only, never code


def test_body_limit_counts_streamed_bodies_too(config):
    small = config.replace(max_request_body_bytes=1000)

    def chunks():
        for _ in range(10):
            yield b"x" * 500

    with TestClient(build_app(small, DeadEngine())) as client:
        response = client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413


def test_allowed_origins_get_cors_answers_and_others_are_refused(tmp_path):
    config = make_config(
        model=str(tmp_path),
        stat_loggers=[],
        allowed_hosts=["testserver"],
        allowed_origins=["https://ui.example"],
    )
    engine = DeadEngine()
    engine.tokenizer = [0] * 100  # a vocabulary size for the route's checks
    prompt = {"prompt": [1, 2]}
    with TestClient(build_app(config, engine)) as client:
        preflight = client.options(
            "/v1/completions",
            headers={
                "origin": "https://ui.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
        allowed = client.post(
            "/v1/completions", json=prompt, headers={"origin": "https://ui.example"}
        )
        assert allowed.status_code == 503  # through the guard, to the (dead) engine
        refused = client.post(
            "/v1/completions", json=prompt, headers={"origin": "https://other.example"}
        )
        assert refused.status_code == 403
