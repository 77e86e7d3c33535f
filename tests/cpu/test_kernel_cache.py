"""The kernel cache under a build cut short: a process SIGKILLed, or exiting, while its
background build runs leaves no partial file behind, and the next start reuses the
objects that finished and compiles only what was missing.

Each run is a real process building a small two-source library (one source compiled
into it serially, as the fused decode step's are) into an empty cache. The compiler is
``$CC``, a wrapper that logs every source it compiles and, while asked to, stops on the
main source (the last object before the link) so that the test can end the process
there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from enginecore_cpu import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no C compiler: kernels unavailable"
)

_WRAPPER = """\
#!{python}
import os, sys, time
sources = [a for a in sys.argv[1:] if a.endswith(".c")]
with open({log!r}, "a") as log:
    log.write(" ".join(os.path.basename(s) for s in sources) + "\\n")
if any(s.endswith("main.c") for s in sources) and os.path.exists({hold!r}):
    # held as gcc's driver waits on cc1: a child process of its own does the work
    import subprocess
    child = subprocess.Popen(["sleep", "60"])
    with open({started!r}, "w") as f:
        f.write(f"{{os.getpid()}} {{child.pid}}")
    child.wait()
os.execvp("gcc", ["gcc", *sys.argv[1:]])
"""

_CHILD = """\
import sys, time
from pathlib import Path
from enginecore_cpu import cpu_kernels, kernel_cache

kernel_cache._slots = kernel_cache.Slots(2)  # both sources side by side, on any machine

def build():
    return cpu_kernels.build(
        Path(sys.argv[1]), source=Path(sys.argv[2]), stem="ec_test_lib",
        serial_sources=(Path(sys.argv[3]),),
    )

if sys.argv[4] == "background":  # started, then the process goes on to other work
    cpu_kernels.build_in_background(build)
    time.sleep(120)
elif sys.argv[4] == "exit":  # started, then the process exits with the build running
    cpu_kernels.build_in_background(build)
    while not Path(sys.argv[5]).exists():  # told to exit by the test
        time.sleep(0.05)
else:
    print(build())
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "cache": tmp_path / "cache",
        "log": tmp_path / "compiled.log",
        "hold": tmp_path / "hold",
        "started": tmp_path / "started",
        "exit": tmp_path / "exit",
        "wrapper": tmp_path / "cc-wrapper",
        "main": tmp_path / "main.c",
        "serial": tmp_path / "serial.c",
    }
    paths["wrapper"].write_text(
        _WRAPPER.format(
            python=sys.executable,
            log=str(paths["log"]),
            hold=str(paths["hold"]),
            started=str(paths["started"]),
        )
    )
    paths["wrapper"].chmod(0o755)
    paths["serial"].write_text("float ec_test_twice(float x) { return 2.0f * x; }\n")
    paths["main"].write_text(
        textwrap.dedent("""\
            float ec_test_twice(float x);
            float ec_test_four_times(float x) { return ec_test_twice(ec_test_twice(x)); }
        """)
    )
    yield paths
    if paths["started"].exists():  # the held compiler, if it outlived its process
        for pid in _held_pids(paths):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _held_pids(paths: dict[str, Path]) -> list[int]:
    """The held compiler's pid and its child's (cc1's stand-in)."""
    return [int(pid) for pid in paths["started"].read_text().split()]


def _running(pid: int) -> bool:
    """False once the process is gone or a zombie (dead, waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _start(sandbox: dict[str, Path], mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(sandbox["cache"]),
            str(sandbox["main"]),
            str(sandbox["serial"]),
            mode,
            str(sandbox["exit"]),
        ],
        env={**os.environ, "CC": str(sandbox["wrapper"])},
        stdout=subprocess.PIPE,
    )


def _wait_for(path: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert process.poll() is None, "the build process ended before its build was held"
        assert time.monotonic() < deadline, "the build never reached the held source"
        time.sleep(0.05)


def _finished_objects(cache: Path) -> list[Path]:
    """Object files in the cache outside any scratch folder."""
    return [
        p
        for p in cache.rglob("*.o")
        if not any(part.startswith((".", "tmp")) for part in p.relative_to(cache).parts)
    ]


def _compiled(sandbox: dict[str, Path]) -> list[str]:
    return sandbox["log"].read_text().split()


def _build_again(sandbox: dict[str, Path]) -> Path:
    sandbox["hold"].unlink(missing_ok=True)
    process = _start(sandbox, "foreground")
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0
    return Path(out.decode().strip())


def _leftovers(cache: Path, library: Path) -> list[str]:
    """Files in the cache that are neither the finished library, a cached object nor a
    lock file: what an interrupted build left behind."""
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if p.is_file() and p != library and p.suffix not in (".o", ".lock")
    )


@pytest.mark.parametrize("end", ["sigkill", "exit"])
def test_a_build_cut_short_leaves_nothing_partial_and_is_resumed(sandbox, end):
    sandbox["hold"].touch()
    process = _start(sandbox, "background" if end == "sigkill" else "exit")
    try:
        _wait_for(sandbox["started"], process)
        # the sources compile side by side: let the serial one finish (bounded: a cache
        # that keeps no objects never shows one)
        deadline = time.monotonic() + 10
        while not _finished_objects(sandbox["cache"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if end == "sigkill":
            process.send_signal(signal.SIGKILL)
        else:
            sandbox["exit"].touch()
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert sorted(_compiled(sandbox)) == ["main.c", "serial.c"]  # both started
    # nothing of the build outlives its process: not the compiler, nor its own child
    deadline = time.monotonic() + 10
    while any(map(_running, _held_pids(sandbox))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in _held_pids(sandbox) if _running(pid)] == []

    library = _build_again(sandbox)

    assert library.exists() and library.parent == sandbox["cache"]
    assert _leftovers(sandbox["cache"], library) == []
    # the restart compiled only the missing object, then linked
    assert _compiled(sandbox)[2:] == ["main.c"]
    # and what it built works
    import ctypes

    lib = ctypes.CDLL(str(library))
    lib.ec_test_four_times.restype = ctypes.c_float
    lib.ec_test_four_times.argtypes = [ctypes.c_float]
    assert lib.ec_test_four_times(1.5) == 6.0


def test_a_finished_build_is_reused_without_compiling(sandbox):
    first = _build_again(sandbox)
    compiled = _compiled(sandbox)
    assert _build_again(sandbox) == first
    assert _compiled(sandbox) == compiled  # nothing compiled the second time
    assert _leftovers(sandbox["cache"], first) == []


def test_compilers_queue_for_the_slots(tmp_path, monkeypatch):
    """Libraries built side by side (a first load's background builds) run no more
    compilers at once than ``compile_slots()``: half the cores, at least one."""
    import shutil
    import threading

    from enginecore_cpu import kernel_cache

    assert kernel_cache.compile_slots() == max(1, len(os.sched_getaffinity(0)) // 2)
    log = tmp_path / "runs"
    wrapper = tmp_path / "cc"
    compiler = shutil.which("gcc")
    # each run logs its start and end (append is atomic for lines this short)
    wrapper.write_text(
        f'#!/bin/sh\necho start >> {log}\nsleep 0.3\n{compiler} "$@"\nrc=$?\n'
        f"echo end >> {log}\nexit $rc\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    sources = []
    for i in range(3):
        source = tmp_path / f"lib{i}.c"
        source.write_text(f"int ec_lib{i}(void) {{ return {i}; }}\n")
        sources.append(source)

    def most_at_once(slots: int) -> int:
        log.unlink(missing_ok=True)
        monkeypatch.setattr(kernel_cache, "_slots", kernel_cache.Slots(slots))
        cache = tmp_path / f"cache{slots}"

        def build(source: Path, rank: int) -> None:
            kernel_cache.asking_as(rank)  # a background build: queued (none waits for it)
            cpu_kernels.build(cache, source=source, stem=source.stem)

        ranks = kernel_cache.ranks(len(sources))
        threads = [
            threading.Thread(target=build, args=(s, r)) for s, r in zip(sources, ranks, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert len(list(cache.glob("*.so"))) == 3
        running = most = 0
        for line in log.read_text().split():
            running += 1 if line == "start" else -1
            most = max(most, running)
        return most

    assert most_at_once(1) == 1  # one after another
    assert most_at_once(3) > 1  # side by side where there are slots


def test_an_idle_build_compiles_at_a_lower_cpu_priority(tmp_path, monkeypatch):
    """A build nothing waits for (the fused decode step's, started once the engine is up)
    runs its compilers under ``SCHED_IDLE`` (and niced), so that they take only the CPU
    the engine leaves: niced alone, a compiler still took time slices from the engine's
    threads and held up the first requests of a first load."""
    log = tmp_path / "niceness"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        f"open({str(log)!r}, 'a').write(f'{{os.nice(0)}}:{{os.sched_getscheduler(0)}}\\n')\n"
        "os.execvp('gcc', ['gcc', *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    done = []

    def build(stem: str) -> Path:
        source = tmp_path / f"{stem}.c"
        source.write_text(f"int ec_{stem}(void) {{ return 7; }}\n")
        path = cpu_kernels.build(tmp_path / "cache", source=source, stem=stem)
        done.append(path)
        return path

    from enginecore_cpu import kernel_cache

    # as at a first load, before any step: a build nothing waits for after an engine of
    # this process served is niced too (kernel_cache.serving_started)
    monkeypatch.setattr(kernel_cache, "_serving", [False])
    cpu_kernels.build_in_background(lambda: build("plain"))

    cpu_kernels.build_in_background(kernel_cache.idle(lambda: build("idle")))
    deadline = time.monotonic() + 120
    while len(done) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ours, policy = os.nice(0), os.sched_getscheduler(0)
    # each: one compile and one link; the idle build's 10 higher and under SCHED_IDLE
    runs = sorted(tuple(int(n) for n in line.split(":")) for line in log.read_text().split())
    assert runs == [(ours, policy)] * 2 + [(ours + 10, os.SCHED_IDLE)] * 2


def test_two_processes_on_one_empty_cache_compile_it_once(sandbox):
    """Two engines starting on one empty cache: the second waits for the first's build
    of a library (a lock file per library in the cache) instead of compiling it again,
    and both load the whole file."""
    sandbox["wrapper"].write_text(
        f"#!{sys.executable}\nimport os, sys, time\n"
        "sources = [a for a in sys.argv[1:] if a.endswith('.c')]\n"
        f"with open({str(sandbox['log'])!r}, 'a') as log:\n"
        "    log.write(' '.join(os.path.basename(s) for s in sources) + '\\n')\n"
        "if any(s.endswith('main.c') for s in sources):\n"
        f"    open({str(sandbox['started'])!r}, 'w').close()\n"
        f"    while os.path.exists({str(sandbox['hold'])!r}):\n"
        "        time.sleep(0.05)\n"
        "os.execvp('gcc', ['gcc', *sys.argv[1:]])\n"
    )
    sandbox["hold"].touch()
    first = _start(sandbox, "foreground")
    second = None
    try:
        _wait_for(sandbox["started"], first)  # the first is compiling main.c, held
        second = _start(sandbox, "foreground")
        time.sleep(2.0)  # the second has reached the library's build meanwhile
        sandbox["hold"].unlink()
        outs = [p.communicate(timeout=120)[0].decode().strip() for p in (first, second)]
    finally:
        sandbox["hold"].unlink(missing_ok=True)
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert first.returncode == 0 and second.returncode == 0
    assert outs[0] == outs[1]
    assert sorted(_compiled(sandbox)) == ["main.c", "serial.c"]  # each source once
    library = Path(outs[0])
    assert _leftovers(sandbox["cache"], library) == []
    import ctypes

    lib = ctypes.CDLL(str(library))
    lib.ec_test_four_times.restype = ctypes.c_float
    lib.ec_test_four_times.argtypes = [ctypes.c_float]
    assert lib.ec_test_four_times(1.5) == 6.0


def test_once_the_engine_serves_a_build_nothing_waits_for_yields_the_cpu(tmp_path, monkeypatch):
    """Once the engine serves steps (``serving_started``), a library the steps are served
    without while it compiles is compiled at niceness 19 (at the default niceness a
    compiler held a core that every OpenMP barrier of a step waited for); one that a
    thread waits for keeps the default and goes ahead of the queue."""
    from enginecore_cpu import kernel_cache

    log = tmp_path / "niceness"
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        "name = [os.path.basename(a) for a in sys.argv if a.endswith(('.c', '.o'))][0]\n"
        f"open({str(log)!r}, 'a').write(f'{{name[:4]}}:{{os.nice(0)}}\\n')\n"
        "os.execvp('gcc', ['gcc', *sys.argv[1:]])\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(kernel_cache, "_serving", [False])
    monkeypatch.setattr(kernel_cache, "_slots", kernel_cache.Slots(1))
    kernel_cache.serving_started()
    sources = {}
    for stem in ("bgnd", "wait"):
        sources[stem] = tmp_path / f"{stem}.c"
        sources[stem].write_text(f"int ec_{stem}(void) {{ return 7; }}\n")
    done = []
    cpu_kernels.build_in_background(
        lambda: done.append(cpu_kernels.build(tmp_path / "c", source=sources["bgnd"], stem="bgnd"))
    )
    cpu_kernels.build(tmp_path / "c", source=sources["wait"], stem="wait")  # this thread waits
    deadline = time.monotonic() + 120
    while not done:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ours = os.nice(0)
    runs = sorted(log.read_text().split())  # a compile and a link each
    assert runs == sorted([f"bgnd:{ours + 19}"] * 2 + [f"wait:{ours}"] * 2), runs
