"""``BuildOnce.serving``: a library missing from the cache is compiled in the background
while the caller is answered None (its torch path serves), and is handed out only after
``adopt_landed``, which the engine calls between steps: a step never sees a library
arrive halfway through. A failed build is logged once and served without for good.

The compiler is ``$CC``, a wrapper that holds the compile until the test lets it go.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from pathlib import Path

import pytest

from enginecore_cpu import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _library(tmp_path: Path) -> cpu_kernels.BuildOnce[ctypes.CDLL]:
    source = tmp_path / "lib.c"
    source.write_text("int ec_seven(void) { return 7; }\n")

    def build(only_path: bool = False) -> Path:
        return cpu_kernels.build(tmp_path / "cache", source=source, stem="lib", only_path=only_path)

    return cpu_kernels.BuildOnce(
        lambda: ctypes.CDLL(str(build())),
        warning="test library unavailable",
        switch="ENGINECORE_TEST_LIBRARY",
        log=logging.getLogger("test_served_while_compiling"),
        target=lambda: build(only_path=True),
        build=build,
    )


def _adopt_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "_next_adopt", [0.0])  # no quarter-second spacing
    cpu_kernels.adopt_landed()


def test_a_library_is_served_only_from_the_step_after_it_lands(tmp_path, monkeypatch):
    hold = tmp_path / "hold"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys, time\n"
        f"while os.path.exists({str(hold)!r}):\n    time.sleep(0.05)\n"
        "os.execvp('gcc', ['gcc', *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    hold.touch()
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(cpu_kernels, "_pending", [])
    library = _library(tmp_path)
    started = time.monotonic()
    assert library.serving() is None  # compiling, held: nothing waited
    assert time.monotonic() - started < 5
    assert library.compiling is not None
    _adopt_now(monkeypatch)
    assert library.serving() is None  # still compiling
    hold.unlink()
    deadline = time.monotonic() + 120
    while library.compiling.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert library.serving() is None  # landed, but only a step's start takes it up
    _adopt_now(monkeypatch)
    lib = library.serving()
    assert lib is not None and lib.ec_seven() == 7
    assert cpu_kernels._pending == []


def test_a_failed_background_build_is_logged_once_and_served_without(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(cpu_kernels, "_pending", [])
    library = _library(tmp_path)
    assert library.serving() is None
    assert library.compiling is not None
    library.compiling.join(timeout=60)
    with caplog.at_level(logging.WARNING):
        _adopt_now(monkeypatch)
        _adopt_now(monkeypatch)
    assert library.failed and library.serving() is None
    assert sum("test library unavailable" in r.message for r in caplog.records) == 1
