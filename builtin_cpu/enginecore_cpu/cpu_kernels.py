"""Fused float32 CPU kernels, compiled from ``cpu_kernels.c`` on first use.

A small-batch CPU step is dominated by eager-op overhead, not arithmetic: ``F.rms_norm``
on 8 x 256 floats costs ~15 µs, and the decode step runs ~150 such ops. These kernels
fuse the chains the Llama family runs every layer: residual add + RMS norm, Neox rotary
(in place), SiLU·up, the K/V writes into the paged cache and the decode mirror, and decode
attention over the mirror; plus the copy of a request's context into the mirror and the
greedy argmax. Copies that one thread did while the other core's OpenMP thread waited
are split over the torch threads too: the K/V writes, the mirror fill and the argmax
made a tiny-model 256-request run 4.5% faster.
On AVX2 CPUs the library also holds the projection GEMM (``panel_gemm``) and the
attention of fresh prompts (``prefill_attention``), built on its register tile.

The library is built with the system C compiler (``$CC``, else ``cc``) the first time a
process needs it and cached under ``$ENGINECORE_CACHE_DIR`` (default
``~/.cache/enginecore``), keyed by the source and the flags. It is compiled for the
CPU's x86-64 level (``-march=x86-64-v3`` on AVX2, ``x86-64-v4`` on AVX-512), or the
level ``ENGINECORE_CPU_ISA`` names (one this CPU runs), which the
file name says, so a cache copied to another x86-64 CPU of that level still runs; the
build takes several seconds of ``gcc``, once. No step waits for it: while it compiles in
the background the model runs the plain torch ops, and it serves from the step after it
lands (``BuildOnce.serving``, ``adopt_landed``). Without a compiler, or with
``ENGINECORE_CPU_KERNELS=0``, the model runs the plain torch ops for good (same results up
to float rounding); a failed build is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from ctypes import c_float, c_int, c_int64, c_void_p
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from enginecore import startup_log
from enginecore.errors import ConfigError
from enginecore_cpu import finish_builds, kernel_cache
from enginecore_cpu.mirror_layout import geometry

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -fno-trapping-math changes no result; without it GCC 12 keeps the exp clamp's compares as
# branches on AVX2 and leaves SiLU scalar (3x slower).
FLAGS = [
    "-O3",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
ENV_SWITCH = "ENGINECORE_CPU_KERNELS"

_P, _I64, _F, _I = c_void_p, c_int64, c_float, c_int
_SIGNATURES = {
    "ec_rms_norm": [_P, _I64, _P, _I64, _I, _P, _P, _I64, _I64, _F, _I],
    "ec_rotary": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _I],
    "ec_silu_and_mul": [_P, _P, _I64, _I64, _I],
    "ec_write_kv": [_P, _P, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I, _I],
    "ec_mirror_append": [_P, _P, _P, _I64, _P, _I64, _P, *[_I64] * 7, _I, _I],
    "ec_argmax_rows": [_P, _I64, _I64, _I64, _P, _I],
    "ec_mirror_fill": [_P, _P, _P, _P, _P, _I64, _P, *[_I64] * 11, _I, _I],
    "ec_decode_attention": [_P, _I64, _P, _P, _P, *[_I64] * 9, _F, _P, _I, _I],
    "ec_gemm_pack": [_P, _I64, _I64, _I64, _I64, _I64, _P],
    "ec_gemm": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I, _I],
    "ec_gemm_available": [],
    "ec_prefill_attention": [*[_P, _I64] * 3, _P, _P, *[_I64] * 4, _F, _P, _I],
}
GEMM_PANEL = 16  # output columns per packed panel (EC_PANEL in the C source)

# These return -1 on a bad index or length (nothing written).
_CHECKED = {
    "ec_rotary",
    "ec_write_kv",
    "ec_mirror_append",
    "ec_mirror_fill",
    "ec_decode_attention",
}
_RETURN_INT = _CHECKED | {"ec_gemm", "ec_gemm_pack", "ec_gemm_available", "ec_prefill_attention"}


def _check(status: int, what: str) -> None:
    if status != 0:
        raise IndexError(f"fused CPU kernel: {what} out of range")


def switched_off(variable: str) -> bool:
    """Whether an on-by-default switch such as ``ENGINECORE_CPU_KERNELS`` is set to off."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("ENGINECORE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "enginecore"


def _cpu_signature() -> str:
    """The CPU's feature flags (the ``flags`` line of /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


# x86-64 micro-architecture levels and the flags each needs beyond the previous one; the C
# source uses AVX2 + FMA (level 3) and AVX-512F (level 4) where the compiler enables them.
_X86_LEVELS = (
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}),
    ("x86-64-v2", {"sse4_2", "popcnt", "ssse3"}),
)


ISA_VARIABLE = "ENGINECORE_CPU_ISA"
# The levels ``ENGINECORE_CPU_ISA`` may name, lowest first.
LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")
# torch's own switches that keep its kernels (ATen, oneDNN, MKL) within AVX2: the rest of a
# run under ``ENGINECORE_CPU_ISA=x86-64-v3``; read when torch loads, so set before it.
TORCH_AVX2_SWITCHES = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def detected_instruction_set() -> str:
    """The highest x86-64 level this CPU has; elsewhere ``native``."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "native"
    flags = set(_cpu_signature().split())
    for level, needs in _X86_LEVELS:
        if needs <= flags:
            return level
    return "x86-64"


def instruction_set() -> str:
    """What the libraries are compiled for: the level ``ENGINECORE_CPU_ISA`` names (to
    build for older CPUs, or to rule out a wider kernel), else the highest x86-64 level
    this CPU has, so the built file runs on every x86-64 CPU of that level it is copied
    to; elsewhere the host CPU itself (``native``, with the cache keyed on its flags).
    Raises ``ConfigError`` for a value that is not a level, or one this CPU cannot run."""
    detected = detected_instruction_set()
    chosen = os.environ.get(ISA_VARIABLE, "").strip()
    if not chosen:
        return detected
    if chosen not in LEVELS:
        raise ConfigError(
            f"{ISA_VARIABLE}={chosen!r} is not an x86-64 level: choose one of "
            f"{', '.join(LEVELS)}, or unset it to build for this CPU ({detected})"
        )
    if detected == "native":
        raise ConfigError(
            f"{ISA_VARIABLE}={chosen} names an x86-64 level, but this CPU is "
            f"{platform.machine()}: unset it"
        )
    if LEVELS.index(chosen) > LEVELS.index(detected):
        raise ConfigError(
            f"{ISA_VARIABLE}={chosen}: this CPU runs at most {detected}; choose one of "
            f"{', '.join(LEVELS[: LEVELS.index(detected) + 1])}"
        )
    _warn_wider_torch(chosen)
    return chosen


def isa_chosen() -> bool:
    """Whether ``ENGINECORE_CPU_ISA`` picks the level: the libraries then use exactly that
    level, none of the CPU's extensions beyond it (VNNI, GFNI, BF16, AMX), as a CPU of
    that level without them would run."""
    return bool(os.environ.get(ISA_VARIABLE, "").strip())


def cpu_extensions() -> set[str]:
    """The CPU's feature flags the libraries may use beyond their x86-64 level: none
    under ``ENGINECORE_CPU_ISA``."""
    return set() if isa_chosen() else set(_cpu_signature().split())


_warned_torch: set[str] = set()


def _warn_wider_torch(level: str) -> None:
    """torch picks its kernels' width itself: say once when it uses wider ones than the
    chosen level, and which of its switches keep it within AVX2."""
    capability = torch.backends.cpu.get_cpu_capability()
    if level in _warned_torch or capability in ("AVX2", "DEFAULT", "NO AVX"):
        return
    if level == "x86-64-v4" and capability.startswith("AVX512"):
        return
    _warned_torch.add(level)
    switches = " ".join(f"{k}={v}" for k, v in TORCH_AVX2_SWITCHES.items())
    logger.warning(
        "%s=%s builds enginecore's kernels for that level, but torch's own run %s; set %s "
        "before starting for torch's too",
        ISA_VARIABLE,
        level,
        capability,
        switches,
    )


def cpu_has_amx() -> bool:
    """Whether the CPU exposes AMX tiles for bfloat16 (oneDNN's fast half-precision GEMM);
    not under ``ENGINECORE_CPU_ISA``, which keeps to its level."""
    return "amx_bf16" in cpu_extensions()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


_LOCAL_INCLUDE = re.compile(rb'^#include "([^"]+)"', re.MULTILINE)


def build(
    directory: Path | None = None,
    *,
    source: Path = SOURCE,
    stem: str = "enginecore_cpu_kernels",
    extra_isa: tuple[str, list[str]] | None = None,
    serial_sources: tuple[Path, ...] = (),
    only_path: bool = False,
) -> Path:
    """Compile ``source`` (if this source, these flags and this CPU have no build yet)
    and return its path. ``extra_isa`` (a name suffix, compiler flags) adds instructions
    beyond the x86-64 level. ``serial_sources`` are compiled into the same library
    without OpenMP's threads (``-fopenmp-simd``: their loops run on the calling thread,
    vectorized as in their own builds). With ``only_path``, the path the library has
    or will have, compiling nothing. Raises ``RuntimeError`` with the compiler's output
    on failure."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    isa = instruction_set()
    flags = [*FLAGS, f"-march={isa}"]
    if extra_isa is not None:
        isa, flags = f"{isa}-{extra_isa[0]}", [*flags, *extra_isa[1]]
    host = _cpu_signature() if isa == "native" else ""  # a native build fits this CPU only
    texts = [_source_bytes(path) for path in (source, *serial_sources)]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode(), host.encode()])).hexdigest()[
        :16
    ]
    directory = directory or cache_dir() / "cpu_kernels"
    target = directory / f"{stem}_{isa}_{key}.so"
    if only_path or target.exists():
        return target
    kernel_cache.priority(target)  # its place in the compilers' queue: first asked, first built
    if not kernel_cache.in_background():
        kernel_cache.hurry(target)  # this thread waits for it: no queueing behind others
    # A build started in the background, or by another process on this cache: wait for it.
    with _build_lock(target), kernel_cache.building(target):
        if not target.exists():
            _compile(compiler, flags, source, target, isa, host, serial_sources)
    return target


def _source_bytes(path: Path) -> bytes:
    """A source with the local headers it includes (quant_simd.h): all a build of it
    reads, so a source that includes none is not rebuilt when one of them changes."""
    text = path.read_bytes()
    headers = (path.with_name(n.decode()).read_bytes() for n in _LOCAL_INCLUDE.findall(text))
    return b"\0".join([text, *headers])


def _build_lock(target: Path) -> threading.Lock:
    with _build_locks_guard:
        return _build_locks.setdefault(target, threading.Lock())


_build_locks: dict[Path, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def _compile(
    compiler: str,
    flags: list[str],
    source: Path,
    target: Path,
    isa: str,
    host: str,
    serial_sources: tuple[Path, ...] = (),
) -> None:
    """Compile each source into an object of its own in the cache (kept: a build cut
    short resumes from the objects it finished), then link them into ``target``."""
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    startup_log.logger.info("building %s for %s (once per CPU level; cached)", source.name, isa)
    serial_flags = [f for f in flags if f not in ("-fopenmp", "-shared")] + ["-fopenmp-simd"]
    object_flags = [f for f in flags if f != "-shared"]
    jobs = [(source, object_flags), *((path, serial_flags) for path in serial_sources)]
    rank = kernel_cache.priority(target)
    objects = kernel_cache.in_parallel(
        [
            functools.partial(_object, compiler, job_flags, path, directory, isa, host, rank)
            for path, job_flags in jobs
        ]
    )
    link = [compiler, *flags, *map(str, objects)]
    kernel_cache.publish(
        directory,
        target,
        lambda out: kernel_cache.run_compiler([*link, "-o", out, "-lm"], rank),
    )


def _object(
    compiler: str,
    flags: list[str],
    source: Path,
    directory: Path,
    isa: str,
    host: str,
    rank: int,
) -> Path:
    """The object of ``source`` built with ``flags`` (compiled now if not cached)."""
    text = _source_bytes(source)
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), host.encode()])).hexdigest()
    target = directory / "objects" / f"{source.stem}_{isa}_{key[:16]}.o"
    if not target.exists():
        target.parent.mkdir(exist_ok=True)
        kernel_cache.publish(
            directory,
            target,
            lambda out: kernel_cache.run_compiler(
                [compiler, *flags, "-c", str(source), "-o", out], rank
            ),
        )
    return target


def build_in_background(*builds: Callable[[], Path]) -> None:
    """Run each build (a function compiling one library into the cache) in its own
    thread, so a first start compiles while the weights load instead of one library
    after another when each is first needed; ``build`` waits for a build in progress.
    Their compilers queue for ``kernel_cache.compile_slots()`` slots in the order given
    (what is needed first, first; ``kernel_cache.idle`` builds after all others, under ``SCHED_IDLE``).
    A failure is left for the foreground ``load()`` to report."""

    def run(job: Callable[[], Path], rank: int) -> None:
        kernel_cache.asking_as(rank)  # compiled in the order given, whichever thread runs first
        try:
            with finish_builds.running(job):
                job()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.debug("background kernel build failed: %s", exc)

    for job, rank in zip(builds, kernel_cache.ranks(len(builds)), strict=True):
        threading.Thread(target=run, args=(job, rank), daemon=True, name="enginecore-cc").start()


_Library = TypeVar("_Library")

# How often, between steps, the libraries still compiling are looked for (a stat each).
_ADOPT_EVERY_S = 0.25


class BuildOnce(Generic[_Library]):
    """A kernel library made once per process, on first call, under a lock (threads
    asking meanwhile wait for the one build). The call returns the library, or None when
    ``switch`` is off, ``available()`` says this CPU cannot run it, or ``make`` failed
    (logged once to ``log`` as ``"<warning>: <error>"``); a failure is not
    retried. ``loaded`` and ``failed`` hold the outcome.

    With ``target`` (the library's path in the cache, compiling nothing) and ``build``
    (compiling it there), ``serving()`` gives the library to a step without ever waiting
    for a compiler: where the file is not in the cache yet it is compiled in the
    background and ``serving()`` answers None (the caller's torch path serves) until
    ``adopt_landed()``, called between steps, loads it."""

    def __init__(
        self,
        make: Callable[[], _Library],
        *,
        warning: str,
        switch: str,
        log: logging.Logger,
        available: Callable[[], bool] | None = None,
        target: Callable[[], Path] | None = None,
        build: Callable[[], Path] | None = None,
    ) -> None:
        self._make, self._warning, self._switch, self._log = make, warning, switch, log
        self._available = available
        self._target, self._build = target, build
        self._lock = threading.Lock()
        self.loaded: _Library | None = None
        self.failed = False
        self.compiling: threading.Thread | None = None  # the background build serving() began
        self._build_error: BaseException | None = None

    def __call__(self) -> _Library | None:
        if self.loaded is not None or self.failed:
            return self.loaded
        with self._lock:
            if self.loaded is None and not self.failed:
                if self._off():
                    self.failed = True
                    return None
                started = time.monotonic()
                try:
                    self.loaded = self._make()
                except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                    self.failed = True
                    self._log.warning("%s: %s", self._warning, exc)
                waited = time.monotonic() - started
                if waited >= _LOGGED_WAIT_S:
                    startup_log.logger.info(
                        "waited %.1f s for %s (compiling, or loading it)", waited, self._what()
                    )
        return self.loaded

    def _off(self) -> bool:
        return switched_off(self._switch) or (self._available is not None and not self._available())

    def _what(self) -> str:
        return self._warning.split(" unavailable")[0]

    def serving(self) -> _Library | None:
        """The library for a step: loaded at once where its file is in the cache; while
        it compiles (started here, in the background, the first time it is missing)
        None, until ``adopt_landed`` loads it between steps. Never waits for a compiler."""
        if self.loaded is not None or self.failed or self.compiling is not None:
            return self.loaded
        if self._target is None or self._build is None:
            return self()
        with self._lock:
            if self.loaded is not None or self.failed or self.compiling is not None:
                return self.loaded
            missing = False
            if not self._off():
                try:
                    missing = not self._target().exists()
                except RuntimeError:  # no compiler: the call below says so, once
                    missing = False
            if missing:
                self.compiling = threading.Thread(
                    target=self._compile, args=(kernel_cache.ranks(1)[0],), daemon=True,
                    name="enginecore-cc",
                )  # fmt: skip
                self.compiling.start()
                with _pending_guard:
                    _pending.append(self)
                startup_log.logger.info(
                    "%s not built yet: the steps are served without it until it is "
                    "(compiling in the background)",
                    self._what(),
                )
                return None
        return self()

    def possible(self) -> bool:
        """Whether the library is loaded or can be (switched on, this CPU can run it, a
        compiler to build it, no failed build), without waiting for a build: a layout
        chosen for it at load time then serves once it is in."""
        if self.loaded is not None or self.failed:
            return self.loaded is not None
        return not self._off() and _compiler() is not None

    def _compile(self, rank: int) -> None:
        kernel_cache.asking_as(rank)  # a build queued earlier keeps its place
        assert self._build is not None
        try:
            with finish_builds.running(self._build):
                self._build()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            self._build_error = exc

    def _adopt(self) -> bool:
        """Load the library if its background build has ended (between steps only);
        whether it has."""
        assert self.compiling is not None and self._target is not None
        if self.compiling.is_alive():
            if not self._target().exists():
                return False
            self.compiling.join(timeout=0.5)  # landed: the thread has only to return
            if self.compiling.is_alive():
                return False
        with self._lock:
            self.compiling = None
            if self._build_error is not None:
                self.failed = True
                self._log.warning("%s: %s", self._warning, self._build_error)
        lib = self()
        if lib is not None:
            startup_log.logger.info("%s built: the steps use it from now on", self._what())
        return True


_pending: list[BuildOnce[Any]] = []
_pending_guard = threading.Lock()
_next_adopt = [0.0]
# A foreground wait at least this long is logged (a library compiled while a load waits).
_LOGGED_WAIT_S = 0.5


def adopt_landed() -> None:
    """Between steps: load the libraries whose background builds (``BuildOnce.serving``)
    have landed, so that from the next step on they serve. A step never sees a library
    arrive halfway through."""
    kernel_cache.serving_started()
    if not _pending or time.monotonic() < _next_adopt[0]:
        return
    _next_adopt[0] = time.monotonic() + _ADOPT_EVERY_S
    with _pending_guard:
        waiting = list(_pending)
    for library in waiting:
        if library._adopt():
            with _pending_guard:
                _pending.remove(library)


class CpuKernels:
    """The loaded library, called with tensors (float32, CPU, innermost dim contiguous)."""

    def __init__(self, path: Path) -> None:
        # torch is imported (and its libgomp loaded) first, so the library binds to the
        # same OpenMP runtime instead of starting a second thread pool.
        self.lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            getattr(self.lib, name).argtypes = argtypes
            getattr(self.lib, name).restype = _I if name in _RETURN_INT else None

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMS norm of ``x`` [T, D]; with ``residual``, first ``residual += x`` (in place)
        and normalize the sum."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=torch.float32)
        res_ptr, res_stride = (
            (0, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        )
        self.lib.ec_rms_norm(
            x.data_ptr(),
            x.stride(0),
            res_ptr,
            res_stride,
            residual is not None,
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Rotate ``x`` [T, H, D] in place at ``positions`` (int64)."""
        tokens, heads, dim = x.shape
        status = self.lib.ec_rotary(
            x.data_ptr(),
            x.stride(0),
            tokens,
            heads,
            dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            torch.get_num_threads(),
        )
        _check(status, "a position beyond the rotary table")
        return x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x`` = [gate | up], contiguous [T, 2I]."""
        tokens, width = x.shape
        out = torch.empty((tokens, width // 2), dtype=torch.float32)
        self.lib.ec_silu_and_mul(
            x.data_ptr(), out.data_ptr(), tokens, width // 2, torch.get_num_threads()
        )
        return out

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Scatter ``key``/``value`` [T, H, D] into ``kv_cache`` [2, blocks, bs, H, D]."""
        tokens, h, d = key.shape
        half = kv_cache[0].numel()
        base = kv_cache.data_ptr()
        status = self.lib.ec_write_kv(
            base,
            base + half * kv_cache.element_size(),
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            slots.data_ptr(),
            tokens,
            h * d,
            half // (h * d),
            torch.get_num_threads(),
            KV_TYPES[kv_cache.dtype],
        )
        _check(status, "a slot beyond the KV cache")

    def mirror_append(
        self, layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: torch.Tensor
    ) -> None:
        """Write this step's ``key``/``value`` [n, H_kv, D] into a decode-mirror layer
        (``mirror_layout.geometry``) at position ``lens - 1`` of each row."""
        n, h, d = key.shape
        at = geometry(layer)
        status = self.lib.ec_mirror_append(
            at.k,
            at.v,
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            lens.data_ptr(),
            n,
            h,
            d,
            at.row_stride,
            at.chunk,
            at.chunk_stride,
            at.capacity,
            torch.get_num_threads(),
            KV_TYPES[layer.dtype],
        )
        _check(status, "a decode length beyond the mirror's capacity")

    def mirror_fill(
        self,
        layer: torch.Tensor,
        kv_cache: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        row0: int,
    ) -> None:
        """Copy request ``i``'s first ``lens[i]`` positions from ``kv_cache`` [2, blocks,
        bs, H_kv, D] (its blocks: row ``i`` of ``table``, int64) into row ``row0 + i`` of
        a decode-mirror layer (``mirror_layout.geometry``) of the cache's dtype."""
        if layer.dtype != kv_cache.dtype:
            raise TypeError(f"a {layer.dtype} mirror filled from a {kv_cache.dtype} cache")
        _, rows, *_, d = layer.shape
        _, num_blocks, block_size, h, _ = kv_cache.shape
        at, cache = geometry(layer), kv_cache.data_ptr()
        status = self.lib.ec_mirror_fill(
            at.k,
            at.v,
            cache,
            cache + kv_cache[0].numel() * kv_cache.element_size(),
            table.data_ptr(),
            table.stride(0),
            lens.data_ptr(),
            table.shape[0],
            row0,
            rows,
            h,
            d,
            at.row_stride,
            at.chunk,
            at.chunk_stride,
            at.capacity,
            block_size,
            num_blocks,
            torch.get_num_threads(),
            KV_TYPES[layer.dtype],
        )
        _check(status, "a block id, row or length beyond the cache or the mirror")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Index of each row's maximum of a [rows, cols] tensor with contiguous rows (the
        first on ties, the first NaN if any: numpy's ``argmax(axis=1)``)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        if cols == 0:
            raise ValueError("argmax of an empty row")
        self.lib.ec_argmax_rows(
            x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(), torch.get_num_threads()
        )
        return out

    def decode_attention(
        self,
        query: torch.Tensor,
        layer: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Attention of one query per row (``query`` [n, H_q, D]) over a decode-mirror
        layer (``mirror_layout.geometry``), row ``r`` over its first ``lens[r]`` positions
        (its last ``window`` with a window); returns [n, H_q, D]."""
        n, hq, d = query.shape
        hkv = layer.shape[-3]
        out = torch.empty((n, hq, d), dtype=torch.float32)
        at = geometry(layer)
        status = self.lib.ec_decode_attention(
            query.data_ptr(),
            query.stride(0),
            at.k,
            at.v,
            lens.data_ptr(),
            n,
            hkv,
            hq // hkv,
            d,
            at.row_stride,
            at.chunk,
            at.chunk_stride,
            at.capacity,
            window or 0,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
            KV_TYPES[layer.dtype],
        )
        _check(status, "a decode length beyond the mirror's capacity")
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of fresh prompts over their own keys, into ``out``: prompt i
        is rows ``starts[i] .. starts[i] + lens[i] - 1`` (int64 tensors) of ``query``
        [T, H_q, D], ``key`` and ``value`` [T, H_kv, D] (heads contiguous, any token
        stride), and of ``out`` [T, H_q, D] (contiguous). Needs AVX2 and FMA and D a
        multiple of 16 (``prefill_attention_max_len``)."""
        _, hq, d = query.shape
        hkv = key.shape[1]
        status = self.lib.ec_prefill_attention(
            query.data_ptr(),
            query.stride(0),
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            starts.data_ptr(),
            lens.data_ptr(),
            starts.shape[0],
            hkv,
            hq // hkv,
            d,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("prefill attention: no memory for its per-thread buffers")
        if status != 0:
            raise ValueError(
                f"prefill attention takes non-empty prompts and a head dim that is a multiple "
                f"of 16 on an AVX2 CPU (head dim {d})"
            )

    def gemm_available(self) -> bool:
        """Whether ``gemm`` was built (it needs AVX2 and FMA)."""
        return bool(self.lib.ec_gemm_available())

    def gemm_pack(self, weight: torch.Tensor, half: int = 0) -> torch.Tensor:
        """A float32 [out, in] weight (any strides) copied into the panels ``gemm`` reads.
        With ``half``, the weight is gate rows then up rows, ``half`` each (a multiple of
        8), packed in pairs so that ``gemm`` can apply ``silu(gate) * up`` as it stores."""
        n, k = weight.shape
        if half and (half % 8 or n != 2 * half):
            raise ValueError(f"a gated pack needs 2 x a multiple of 8 rows, not {n} = 2 x {half}")
        panels = torch.empty(-(-n // GEMM_PANEL) * GEMM_PANEL * k, dtype=torch.float32)
        self.lib.ec_gemm_pack(
            weight.data_ptr(), weight.stride(0), weight.stride(1), n, k, half, panels.data_ptr()
        )
        return panels

    def gemm(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        half: int = 0,
        silu: bool = False,
    ) -> torch.Tensor:
        """``x [m, k]`` (contiguous rows) times the ``n``-output weight packed in
        ``panels`` (gated when ``half``, as ``gemm_pack``), plus ``bias`` (float32,
        contiguous) if given: [m, n], or with ``silu`` [m, half] = silu(gate) * up."""
        m, k = x.shape
        width = half if silu else n
        out = torch.empty((m, width), dtype=torch.float32)
        if m:
            status = self.lib.ec_gemm(
                x.data_ptr(),
                x.stride(0),
                m,
                k,
                panels.data_ptr(),
                n,
                None if bias is None else bias.data_ptr(),
                out.data_ptr(),
                width,
                half,
                int(silu),
                torch.get_num_threads(),
            )
            if status != 0:
                raise RuntimeError(
                    "ec_gemm is not built on this CPU (it needs AVX2 and FMA)"
                    if not self.gemm_available()
                    else f"ec_gemm: a gated call (half {half}) does not fit {n} outputs"
                )
        return out


library: BuildOnce[CpuKernels] = BuildOnce(
    lambda: CpuKernels(build()),
    warning="fused CPU kernels unavailable, using torch ops",
    switch=ENV_SWITCH,
    log=logger,
    target=lambda: build(only_path=True),
    build=build,
)


def load() -> CpuKernels | None:
    """The kernels, built on first call; None when disabled or unbuildable (the model
    then runs the torch ops)."""
    return library()


def heads_contiguous(*tensors: torch.Tensor) -> bool:
    """Whether each [T, H, D] tensor has contiguous heads (any token stride), as the
    kernels read them."""
    return all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in tensors)


MAX_ATTENTION_GROUP = 16  # query heads per KV head (EC_MAX_GROUP in the C source)
MAX_ATTENTION_DIM = 256  # head dim (EC_MAX_DIM)


def decode_attention_fits(group: int, head_dim: int) -> bool:
    """Whether ``decode_attention`` takes this many query heads per KV head and head dim."""
    return 1 <= group <= MAX_ATTENTION_GROUP and 1 <= head_dim <= MAX_ATTENTION_DIM


# The prefill kernel keeps a task's transposed keys and its scores ([48, keys]) per thread;
# past about L2's size (512 KiB on the AVX2 CPUs this kernel runs on) SDPA's blocked kernel is as fast or faster. At
# head dim 64: 1.9-2x SDPA on prompts of 32-128 tokens, 1.75x at 512, 1.27x at 1,024 and
# 0.98x at 2,048; at head dim 128: 2x at 256, 1.09x at 768, 0.94x at 1,024.
PREFILL_ATTENTION_BYTES = 512 * 1024
PREFILL_QUERY_BLOCK = 48  # EC_QBLOCK in the C source


def prefill_attention_max_len(kernels: CpuKernels, head_dim: int) -> int:
    """The longest fresh prompt ``prefill_attention`` should take at this head dim: 0
    where it does not run (no AVX2 GEMM, or a head dim that is not a multiple of 16)."""
    if head_dim % 16 or not kernels.gemm_available():
        return 0
    return PREFILL_ATTENTION_BYTES // ((head_dim + PREFILL_QUERY_BLOCK) * 4)


#: The element types the K/V kernels take (EC_KV_* in kv_types.h).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_kernels_for(kv: torch.Tensor, *tensors: torch.Tensor) -> CpuKernels | None:
    """``kernels_for(*tensors)`` where ``kv`` (a KV cache or mirror layer) may also hold
    float16 or bfloat16 (``cache.kv_cache_dtype``), which the K/V kernels read and write
    themselves."""
    if kv.dtype not in KV_TYPES or not kv.is_cpu:
        return None
    return kernels_for(*tensors)


def kernels_for(*tensors: torch.Tensor) -> CpuKernels | None:
    """The kernels when every tensor a call reads or writes is a float32 CPU tensor and
    they are enabled (they take raw float pointers: a narrower tensor would be overrun)."""
    for x in tensors:  # is_cpu: no device object and type string made per check
        if x.dtype is not torch.float32 or not x.is_cpu:
            return None
    return library.loaded if library.loaded is not None else library.serving()
