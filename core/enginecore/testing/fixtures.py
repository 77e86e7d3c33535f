"""pytest fixtures for plugin authors: a model, an engine, an engine process, a server.

Loaded with ``pytest -p enginecore.testing`` (the kit is never auto-loaded). Nothing
heavy is imported until a test asks for a fixture. Select your plugin by overriding
``enginecore_config_overrides`` (flat config names) in your ``conftest.py``::

    @pytest.fixture(scope="module")
    def enginecore_config_overrides():
        return {"scheduling_policy": "my-policy"}

The model is a tiny random-weight Llama checkpoint made offline once per test run, or
the checkpoint named by ``--enginecore-model PATH`` (``--enginecore-model demo``: the
real SmolLM2-135M demo model, converted once into the cache).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SERVER_START_TIMEOUT_S = 180.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("enginecore", "enginecore plugin conformance kit")
    if any("--enginecore-model" in option.names() for option in group.options):
        return  # loaded twice (the entry point and ``-p enginecore.testing``): add once
    group.addoption(
        "--enginecore-model",
        default=None,
        metavar="PATH",
        help="checkpoint for the enginecore_* fixtures ('demo': the demo model; "
        "default: a tiny random Llama made offline)",
    )


@pytest.fixture(scope="session")
def enginecore_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Path of the checkpoint the engine fixtures serve."""
    from enginecore import checkpoints

    chosen = request.config.getoption("--enginecore-model", default=None)
    if chosen == "demo":
        return Path(checkpoints.make_demo_checkpoint())
    if chosen:
        return Path(chosen)
    root = tmp_path_factory.mktemp("enginecore-model")
    return Path(checkpoints.make_random_checkpoint(root / "llama-tiny", arch="llama"))


@pytest.fixture(scope="module")
def enginecore_config_overrides() -> dict[str, Any]:
    """Flat config names applied to every engine fixture; override it to select a plugin."""
    return {}


def _engine_config(model: Path, overrides: dict[str, Any], **defaults: Any) -> Any:
    from enginecore import make_config

    flat: dict[str, Any] = {"model": str(model), "num_blocks_override": 256, "max_model_len": 1024}
    flat.update(defaults)
    flat.update(overrides)
    return make_config(**flat)


@pytest.fixture(scope="module")
def enginecore_llm(
    enginecore_model: Path, enginecore_config_overrides: dict[str, Any]
) -> Iterator[Any]:
    """An in-process ``LLM`` (engine core in this process: easy to debug and inspect)."""
    from enginecore import LLM

    config = _engine_config(enginecore_model, enginecore_config_overrides, multiprocessing=False)
    with LLM(config=config) as llm:
        yield llm


@pytest.fixture(scope="module")
def enginecore_engine_process(
    enginecore_model: Path, enginecore_config_overrides: dict[str, Any]
) -> Iterator[Any]:
    """An ``LLM`` whose engine core runs in its own process, over ZeroMQ (the default)."""
    from enginecore import LLM

    config = _engine_config(enginecore_model, enginecore_config_overrides, multiprocessing=True)
    with LLM(config=config) as llm:
        yield llm


@dataclass
class RunningServer:
    """A live ``enginecore serve``: ``url`` for any HTTP or OpenAI client."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    model: str

    @property
    def base_url(self) -> str:
        """For ``openai.OpenAI(base_url=server.base_url, api_key="none")``."""
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(server: RunningServer) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(
                f"enginecore serve exited with {server.process.returncode}:\n{server.log()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    pytest.fail(f"enginecore serve did not become healthy:\n{server.log()}")


@pytest.fixture(scope="module")
def enginecore_server(
    enginecore_model: Path,
    enginecore_config_overrides: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    """A real ``enginecore serve`` subprocess on a free loopback port, with
    ``/collective_rpc`` enabled (so ``enginecore rpc`` works against it)."""
    tmp = tmp_path_factory.mktemp("enginecore-server")
    config_file = tmp / "engine.json"
    flat = {"num_blocks_override": 256, "max_model_len": 1024}
    flat.update(enginecore_config_overrides)
    config_file.write_text(json.dumps(flat))
    port = _free_port()
    log_path = tmp / "server.log"
    command = [
        sys.executable,
        "-m",
        "enginecore.cli",
        "serve",
        str(enginecore_model),
        "--config",
        str(config_file),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-collective-rpc-endpoint",
    ]
    env = {k: v for k, v in os.environ.items() if k != "ENGINECORE_API_KEY"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path, str(enginecore_model))
    try:
        _wait_healthy(server)
        yield server
    finally:
        process.send_signal(2)  # SIGINT: uvicorn stops, and the engine process with it
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
