"""Regressions found by the schemathesis run (tests/server/test_schemathesis.py), in-process."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from enginecore import make_config
from enginecore.server.app import build_app


class HealthyEngine:
    """A stand-in engine that answers health checks and records RPCs."""

    max_model_len = 128
    tokenizer = None
    components: dict = {}

    def __init__(self) -> None:
        self.rpc_calls: list = []

        class Plugins:
            def registry(self, kind: str) -> dict:
                return {"model_summary": object()} if kind == "worker_rpc" else {}

        self.plugins = Plugins()

    async def check_health(self) -> None:
        return None

    async def collective_rpc(self, *args) -> list:
        self.rpc_calls.append(args)
        return ["ok"]


@pytest.fixture
def config(tmp_path):
    return make_config(model=str(tmp_path), stat_loggers=[], allowed_hosts=["testserver"])


@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_probes_answer_what_the_schema_documents(config, path):
    with TestClient(build_app(config, HealthyEngine())) as client:
        response = client.get(path)
        documented = client.get("/openapi.json").json()["paths"][path]["get"]["responses"]
    assert response.status_code == 200 and response.content == b""
    # An empty body: the schema must not promise JSON for it.
    assert "content" not in documented["200"], documented
    assert "503" in documented


def test_metrics_is_documented_as_text(config):
    with TestClient(build_app(config, HealthyEngine())) as client:
        documented = client.get("/openapi.json").json()["paths"]["/metrics"]["get"]
    assert list(documented["responses"]["200"]["content"]) == ["text/plain"]


@pytest.mark.parametrize("timeout", [1e308, 0, -1])
def test_collective_rpc_timeout_out_of_range_is_refused_before_the_engine(config, timeout):
    engine = HealthyEngine()
    enabled = config.replace(enable_collective_rpc_endpoint=True)
    with TestClient(build_app(enabled, engine)) as client:
        response = client.post(
            "/collective_rpc", json={"method": "model_summary", "timeout": timeout}
        )
        assert response.status_code == 400, response.text
        assert "timeout" in response.text
        ok = client.post("/collective_rpc", json={"method": "model_summary", "timeout": 5})
    assert ok.status_code == 200 and ok.json() == {"results": ["ok"]}
    assert len(engine.rpc_calls) == 1  # only the valid call reached the engine
