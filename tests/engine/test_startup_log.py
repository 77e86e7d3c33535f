"""Start-up says what it is doing on stderr, at the default log level.

One Python process starts the engine twice (one interpreter start and one import of the
engine for both tests): first at the default settings, then with
``ENGINECORE_STARTUP_LOG=0``; a marker line on stderr divides the two starts' logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from enginecore_cpu import cpu_kernels

SILENCED_START = "--- the start with ENGINECORE_STARTUP_LOG=0 ---"


@pytest.fixture(scope="module")
def two_starts(tiny_llama, tmp_path_factory) -> tuple[str, str]:
    """The stderr of a default start, and of a start with the start-up log silenced."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from enginecore import LLM
        llm = LLM(model={str(tiny_llama)!r}, max_model_len=64, kv_cache_bytes=1 << 22)
        print("READY", flush=True)
        llm.shutdown()
        print({SILENCED_START!r}, file=sys.stderr, flush=True)
        # read by the engine process this start spawns
        os.environ["ENGINECORE_STARTUP_LOG"] = "0"
        LLM(model={str(tiny_llama)!r}, max_model_len=64, kv_cache_bytes=1 << 22).shutdown()
        print("SILENCED READY", flush=True)
        """
    )
    # A cache with nothing of this checkpoint's (weights, tokenizer), but the compiled
    # kernels of the shared one: compiling them is no start-up phase, and
    # cpu/test_cpu_kernels.py builds them from nothing (nor does the silenced start wait
    # for them in the background of a start that ends before they are done).
    cache = tmp_path_factory.mktemp("startup-log-cache")
    shared_kernels = cpu_kernels.cache_dir() / "cpu_kernels"
    shared_kernels.mkdir(parents=True, exist_ok=True)
    (cache / "cpu_kernels").symlink_to(shared_kernels, target_is_directory=True)
    env = {**os.environ, "ENGINECORE_CACHE_DIR": str(cache)}
    env.pop("ENGINECORE_LOG_LEVEL", None)
    env.pop("ENGINECORE_STARTUP_LOG", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert "READY" in done.stdout, done.stderr[-3000:]
    assert "SILENCED READY" in done.stdout, done.stderr[-3000:]
    default_log, silenced_log = done.stderr.split(SILENCED_START)
    return default_log, silenced_log


def test_startup_names_its_phases(two_starts):
    log, _ = two_starts
    phases = [
        "loading weights from",
        "weights loaded and prepared by",
        "allocating the KV cache",
        "engine ready in",
    ]
    for phase in phases:
        assert phase in log, f"{phase!r} missing from the start-up log:\n{log[-3000:]}"
    assert log.index("loading weights from") < log.index("allocating the KV cache")
    assert log.index("allocating the KV cache") < log.index("engine ready in")
    # the slow parts count their progress: every tensor read, every layer prepared
    assert "reading weights: 100%" in log and "preparing weights: 100%" in log, log[-3000:]


def test_startup_log_can_be_silenced(two_starts):
    _, log = two_starts
    # the silenced start did start (and stopped) without an error
    assert "Traceback" not in log, log[-3000:]
    assert "loading weights from" not in log, log[-3000:]
    assert "reading weights" not in log, log[-3000:]
