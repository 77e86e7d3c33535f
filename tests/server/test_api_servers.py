"""``enginecore serve --api-server-count 2``, real processes: two titled API servers and
one titled engine core in ``ps``, both API servers serving a short concurrent load with
no errors, metrics aggregated across them, and the SIGKILL of one API server stopping
the rest with exit status 1 and the dead process named."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.serve_process import serve, stop


def _titled(launcher: psutil.Process) -> dict[str, psutil.Process]:
    """The launcher's children by process title (``ps -o args`` shows the title)."""
    found = {}
    for child in launcher.children(recursive=True):
        try:
            title = " ".join(child.cmdline()).strip()
        except psutil.NoSuchProcess:
            continue
        found[title] = child
    return found


def _connections(proc: psutil.Process, port: int) -> int:
    return sum(
        1
        for c in proc.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def _success_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "enginecore:request_success_total"
    )


def test_two_api_servers_serve_one_engine_and_die_together(tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = serve(
        tiny_llama,
        log,
        "--api-server-count",
        "2",
        "--executor",
        "uni",
        "--max-num-seqs",
        "16",
        "--kv-cache-bytes",
        str(16 << 20),
    )
    port = int(url.rsplit(":", 1)[1])
    try:
        titled = _titled(psutil.Process(proc.pid))
        assert {"EngineCore_DP0", "APIServer_0", "APIServer_1"} <= set(titled), titled
        servers = [titled["APIServer_0"], titled["APIServer_1"]]
        assert titled["EngineCore_DP0"].name() == "EngineCore_DP0"  # ps -o comm

        def complete(i: int) -> httpx.Response:
            with httpx.Client(timeout=120) as client:  # a connection of its own
                body = {"prompt": f"request {i} " * 20, "max_tokens": 16, "stream": True}
                with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    chunks = [line for line in response.iter_lines() if line]
                return response, chunks

        seen = [0, 0]
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(complete, i) for i in range(48)]
            while not all(f.done() for f in futures):
                for k, server in enumerate(servers):
                    seen[k] = max(seen[k], _connections(server, port))
                time.sleep(0.05)
            results = [f.result() for f in futures]
        for response, chunks in results:
            assert response.status_code == 200
            assert chunks[-1] == "data: [DONE]"
            assert not any('"error"' in c for c in chunks)
        assert min(seen) > 0, f"each API server should hold connections under load: {seen}"
        # /metrics (served by either) counts the requests of both.
        assert _success_total(url) == 48

        engine = titled["EngineCore_DP0"]
        servers[1].send_signal(signal.SIGKILL)
        assert proc.wait(60) == 1
        _gone, alive = psutil.wait_procs([engine, servers[0]], timeout=30)
        assert not alive, f"still running after an API server died: {alive}"
        assert "APIServer_1 (pid" in log.read_text() and "SIGKILL" in log.read_text()
    finally:
        if proc.poll() is None:
            stop(proc)


def test_api_server_count_is_validated():
    from enginecore.config import make_config

    with pytest.raises(Exception, match="api_server_count must be >= 1"):
        make_config(api_server_count=0)
