"""``enginecore serve --api-server-count N``: N API server processes in front of one
engine core, so that tokenization, detokenization and HTTP scale past one Python process.

The launcher (the ``enginecore serve`` process) checks the settings, binds the HTTP port
once, starts the engine core (``EngineCore_DP0``) with one input and one output address
per API server, then starts the API servers (``APIServer_0`` ...). Each inherits the
listening socket (the kernel hands each connection to one of them), binds its own
address pair, loads its own tokenizer and runs the usual app (:mod:`launch`) on an
:class:`~enginecore.AsyncLLM` attached to the shared engine
(:mod:`enginecore.engine.attached_engine`). Metrics are aggregated across the API servers
with prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).

The launcher supervises: when any process exits on its own, the others are stopped and
the launcher exits 1 naming it; SIGTERM / SIGINT drain the API servers, then stop the
engine.
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
from typing import Any

import msgspec

from enginecore.config import EngineConfig
from enginecore.engine.attached_engine import ATTACH_ENV
from enginecore.errors import ConfigError
from enginecore.openmp import child_env
from enginecore.runtime_dirs import make_runtime_dir

logger = logging.getLogger("enginecore.server")

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
_ENGINE_ENTRY = "from enginecore.engine.core_proc import main; main()"
_SERVER_ENTRY = "from enginecore.server.api_servers import main; main()"
_POLL_S = 0.2


class _Child:
    def __init__(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.name, self.proc = name, proc

    def describe_exit(self) -> str:
        code = self.proc.returncode
        how = f"exit code {code}"
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        return f"{self.name} (pid {self.proc.pid}) exited with {how}"


def _spawn(entry: str, args: list[str], payload: bytes, **kw: Any) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", entry, *args], stdin=subprocess.PIPE, process_group=0, **kw
    )
    assert proc.stdin is not None  # stdin=PIPE
    proc.stdin.write(payload)
    proc.stdin.close()
    return proc


def _check(config: EngineConfig) -> None:
    """What fails before any process starts, as the one-process server checks it."""
    from enginecore.component_check import check_components
    from enginecore.engine.model_defaults import configured_chat_template
    from enginecore.engine.preflight import check_model_path
    from enginecore.plugins import make_plugin_manager
    from enginecore.server.launch import check_tool_config
    from enginecore.writable_dirs import check_writable_dirs

    if config.parallel.data_parallel_size > 1:
        raise ConfigError(
            "api_server_count > 1 serves one engine core: it cannot be combined with "
            "data_parallel_size > 1 (run one API server in front of the replicas)"
        )
    if not config.engine.multiprocessing:
        raise ConfigError("api_server_count > 1 needs the engine core in its own process")
    check_model_path(config)
    check_writable_dirs(config)
    configured_chat_template(config)
    plugins = make_plugin_manager(config.plugins.enabled, config.plugins.disabled)
    check_components(config, plugins)
    check_tool_config(config, plugins)


def run_api_servers(config: EngineConfig) -> int:
    """Start the engine core and the API servers; supervise them. Returns the exit
    status: 0 after SIGTERM / SIGINT, 1 when a process died (named in the log)."""
    from enginecore.engine.preflight import reserve_port
    from enginecore.server.launch import server_config

    config = server_config(config)
    _check(config)
    count = config.server.api_server_count
    listener = reserve_port(config.server.host, config.server.port)
    rundir = make_runtime_dir("api-servers-")
    metrics_dir = os.path.join(rundir, "metrics")
    os.mkdir(metrics_dir, 0o700)
    inputs = [f"ipc://{rundir}/input{i}" for i in range(count)]
    outputs = [f"ipc://{rundir}/output{i}" for i in range(count)]
    payload = msgspec.msgpack.encode(config)
    children: list[_Child] = []
    stopping: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        engine = _spawn(
            _ENGINE_ENTRY, [",".join(inputs), ",".join(outputs), "0"], payload, env=child_env()
        )
        children.append(_Child("EngineCore_DP0", engine))
        fd = listener.fileno()
        for i in range(count):
            link = {
                "input": inputs[i],
                "output": outputs[i],
                "engine_pid": engine.pid,
                "client_index": i,
            }
            env = {**os.environ, ATTACH_ENV: json.dumps(link), METRICS_ENV: metrics_dir}
            proc = _spawn(_SERVER_ENTRY, [str(i), str(fd)], payload, env=env, pass_fds=(fd,))
            children.append(_Child(f"APIServer_{i}", proc))
        listener.close()  # the API servers hold it now
        logger.info(
            "%d API servers (pids %s) in front of the engine core (pid %d) on %s:%d",
            count,
            ", ".join(str(c.proc.pid) for c in children[1:]),
            engine.pid,
            config.server.host,
            config.server.port,
        )
        return _supervise(children, stopping, metrics_dir)
    finally:
        _stop_all(children, config.engine.shutdown_timeout + 30)
        listener.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        import shutil

        shutil.rmtree(rundir, ignore_errors=True)


def _supervise(children: list[_Child], stopping: list[int], metrics_dir: str) -> int:
    while True:
        if stopping:
            logger.info("stopping: draining the API servers, then the engine core")
            return 0
        for child in children:
            if child.proc.poll() is not None:
                _mark_dead(child.proc.pid, metrics_dir)
                logger.error("%s: stopping the other processes", child.describe_exit())
                return 1
        time.sleep(_POLL_S)


def _mark_dead(pid: int, metrics_dir: str) -> None:
    """prometheus-client's clean-up of a dead process's live gauges."""
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, metrics_dir)  # type: ignore[no-untyped-call]
    except (ImportError, OSError):
        pass


def _stop_all(children: list[_Child], timeout: float) -> None:
    """API servers first (SIGTERM: they drain), then the engine core; SIGKILL after
    ``timeout``."""
    servers = [c.proc for c in children if c.name.startswith("APIServer")]
    engines = [c.proc for c in children if not c.name.startswith("APIServer")]
    for group in (servers, engines):
        for proc in group:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in group:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def main() -> None:
    """One API server: ``INDEX LISTEN_FD`` on the command line, the config on stdin."""
    import asyncio

    from enginecore.proc_title import set_process_title
    from enginecore.server.launch import serve

    index, fd = int(sys.argv[1]), int(sys.argv[2])
    set_process_title(f"APIServer_{index}")
    logging.basicConfig(
        level=os.environ.get("ENGINECORE_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s %(levelname)s [api server {index}] %(name)s: %(message)s",
    )
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    listener = socket.socket(fileno=fd)
    try:
        import uvloop
    except ImportError:
        sys.exit(asyncio.run(serve(config, listener)))
    sys.exit(uvloop.run(serve(config, listener)))
