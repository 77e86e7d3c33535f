"""``enginecore serve`` fails fast on user mistakes: names, paths and ports are checked
before any process starts, with one line naming the mistake and what would be valid."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time

import openai
import pytest

from enginecore.engine.preflight import reserve_port
from enginecore.errors import ConfigError
from tests.helpers.serve_process import free_port, start_cli, stop, wait_healthy


def _serve(args: list[str], timeout: float = 120) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--scheduling-policy", "nope", "unknown scheduling policy 'nope'. Available: fair_share"),
        ("--executor", "nope", "unknown executor 'nope'. Available:"),
        ("--structured-output-backend", "nope", "unknown structured output backend 'nope'"),
    ],
)
def test_an_unknown_component_name_is_one_line_before_any_process(tiny_llama, flag, value, message):
    code, output, _ = _serve([str(tiny_llama), "--port", str(free_port()), flag, value])
    assert code == 2, output
    assert message in output
    assert "Traceback" not in output and "engine core" not in output, output


def test_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    code, output, _ = _serve([str(tmp_path), "--port", str(free_port())])
    assert code == 2, output
    assert output.strip() == (
        f"error: model path {str(tmp_path)!r} is not a checkpoint: it has no config.json "
        "(give a Hugging Face checkpoint directory or a .gguf file)"
    )


def test_a_port_in_use_is_found_before_the_engine_starts(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output, _ = _serve([str(tiny_llama), "--port", str(port)])
    assert code == 2, output
    assert f"port {port} on 127.0.0.1 is already in use" in output
    assert "listening on" not in output and "Traceback" not in output, output


def test_a_second_server_starting_beside_the_first_is_refused_its_port():
    """Two servers started within one start-up window: the port the first one reserved
    while its engine loads is refused to the second at once (SO_REUSEADDR lets two bound,
    non-listening sockets share a port on Linux: the second would load and never serve)."""
    first = reserve_port("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            reserve_port("127.0.0.1", port).close()
    finally:
        first.close()
    reserve_port("127.0.0.1", port).close()  # once the first lets go, the port is free


@pytest.mark.slow
def test_the_port_is_held_while_the_engine_starts(tiny_llama, tmp_path):
    """Bound before the engine starts, not checked and let go: nothing else can take the
    port while the model loads, and the server then answers on it."""
    port, log = free_port(), tmp_path / "server.log"
    flags = ["--max-model-len", "128", "--num-blocks-override", "64"]
    proc = start_cli(["serve", str(tiny_llama), "--port", str(port), *flags], log)
    try:
        deadline = time.monotonic() + 120
        while "starting the executor" not in log.read_text():  # the engine is loading
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0.0)
        assert done.choices[0].text is not None and done.usage.completion_tokens >= 1
    finally:
        stop(proc)


def test_output_into_a_closed_pipe_is_no_traceback():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone, as after `| head` has what it wanted
    try:
        done = subprocess.run(
            [sys.executable, "-m", "enginecore.cli", "config", "show", "--format", "json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--log-level", "LOUD"], "argument --log-level: invalid choice: 'LOUD'"),
        (["--log-level", "LOUD", "plugins"], "argument --log-level: invalid choice: 'LOUD'"),
        (
            ["config", "show", "--kv-connector-extra-config", "{bad"],
            "--kv-connector-extra-config: not valid JSON",
        ),
    ],
)
def test_bad_flag_values_are_named(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", *args], capture_output=True, text=True
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_log_level_after_the_subcommand():
    done = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "config", "show", "--log-level", "debug"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "[model]" in done.stdout


def test_output_kind_is_importable_from_the_package():
    from enginecore import OutputKind

    assert OutputKind.DELTA.name == "DELTA"


def test_the_demo_model_is_served_under_a_name_not_its_cache_path(monkeypatch, tiny_llama):
    from enginecore import checkpoints, cli
    from enginecore.server import launch

    served = []
    monkeypatch.setattr(checkpoints, "make_demo_checkpoint", lambda: tiny_llama)
    monkeypatch.setattr(launch, "run_server", served.append)
    assert cli.main(["serve"]) == 0
    (config,) = served
    assert config.model.path == str(tiny_llama)
    assert config.model.served_model_name == cli.DEMO_MODEL_NAME == "enginecore-demo"
