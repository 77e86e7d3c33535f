"""Schemathesis against a real ``enginecore serve`` on the tiny model, over the OpenAPI
schema the server publishes: no 5xx, documented responses match their schema, and the
server still answers a normal completion afterwards.

Two runs: every route but the engine-state controls, then the controls alone
(``/pause`` and ``/sleep`` make generation answer 503 by design, so they are not mixed
with it); the engine is resumed and woken before the final completion.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.serve_process import serve, stop

pytest.importorskip("schemathesis")

EXAMPLES_PER_OPERATION = 50
CONTROLS = r"^/(pause|resume|sleep|wake_up|is_paused|is_sleeping)$"


def schemathesis(url: str, workdir: Path, *filters: str) -> tuple[int, str]:
    """``st run`` with the two checks; ``(exit status, output)``."""
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [
            str(st),
            "run",
            f"{url}/openapi.json",
            "--checks",
            "not_a_server_error,response_schema_conformance",
            "--max-examples",
            str(EXAMPLES_PER_OPERATION),
            "--seed",
            "1",
            "--request-timeout",
            "120",
            "--no-shrink",
            *filters,
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "NO_COLOR": "1"},
    )
    return result.returncode, result.stdout + result.stderr


def cases_run(output: str) -> int:
    match = re.search(r"(\d+) generated", output)
    assert match, output[-3000:]
    return int(match.group(1))


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tiny_llama, tmp_path) -> None:
    proc, url = serve(
        tiny_llama,
        tmp_path / "server.log",
        "--dtype",
        "float32",
        "--stat-loggers",
        "",
        "--max-model-len",
        "256",
        "--enable-collective-rpc-endpoint",
        "--enable-sleep-mode",
        "--enable-dev-endpoints",
    )
    try:
        status, output = schemathesis(url, tmp_path, "--exclude-path-regex", CONTROLS)
        assert status == 0, output[-6000:]
        routes = cases_run(output)
        assert routes >= 500, output[-3000:]
        status, output = schemathesis(url, tmp_path, "--include-path-regex", CONTROLS)
        assert status == 0, output[-6000:]
        controls = cases_run(output)
        assert controls >= 50, output[-3000:]
        print(f"schemathesis: {routes} + {controls} cases, 0 failures")  # for docs/serving.md
        httpx.post(f"{url}/resume", timeout=30).raise_for_status()
        httpx.post(f"{url}/wake_up", timeout=30).raise_for_status()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        completion = client.completions.create(
            model=str(tiny_llama), prompt="hello", max_tokens=4, temperature=0
        )
        assert completion.usage.completion_tokens == 4
        assert proc.poll() is None
    finally:
        stop(proc)
