"""Start-up says what it is doing on stderr, at the default log level."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from enginecore_cpu import cpu_kernels


def test_startup_names_its_phases(tiny_llama, tmp_path):
    script = textwrap.dedent(
        f"""
        from enginecore import LLM
        llm = LLM(model={str(tiny_llama)!r}, max_model_len=64, kv_cache_bytes=1 << 22)
        print("READY", flush=True)
        llm.shutdown()
        """
    )
    # A cache with nothing of this checkpoint's (weights, tokenizer), but the compiled
    # kernels of the shared one: compiling them is no start-up phase, and
    # cpu/test_cpu_kernels.py builds them from nothing.
    shared_kernels = cpu_kernels.cache_dir() / "cpu_kernels"
    shared_kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cpu_kernels").symlink_to(shared_kernels, target_is_directory=True)
    env = {**os.environ, "ENGINECORE_CACHE_DIR": str(tmp_path)}
    env.pop("ENGINECORE_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert "READY" in done.stdout, done.stderr[-3000:]
    log = done.stderr
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


def test_startup_log_can_be_silenced(tiny_llama):
    script = f"from enginecore import LLM; LLM(model={str(tiny_llama)!r}, max_model_len=64, kv_cache_bytes=1 << 22).shutdown()"
    # The shared kernel cache: an empty one would compile the kernels again, in the
    # background of a start that ends before they are done.
    env = {**os.environ, "ENGINECORE_STARTUP_LOG": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loading weights from" not in done.stderr
    assert "reading weights" not in done.stderr
