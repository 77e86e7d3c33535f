"""The fused decode step's profiling build (``-DECD_PROFILE``, as
``benchmarks/step_builds.py`` and ``decode_step_phases.py`` build it): its timeline of a
call, phase by phase, and the preemptions counted in each phase, from which the
benchmarks keep the phases no step thread was preempted in."""

from __future__ import annotations

import ctypes
import itertools
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest

from enginecore_cpu import cpu_kernels, decode_step

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _profiled() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(decode_step.build(("profile", ["-DECD_PROFILE"]))))
    lib.ecd_decode_step.argtypes = decode_step._load().ecd_decode_step.argtypes
    lib.ecd_decode_step.restype = ctypes.c_int
    lib.ecd_profile_phases.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return lib


def _timelines(model: pathlib.Path, busy: bool) -> list[tuple[float, list[float], list[int]]]:
    """Each one-row fused call of a greedy request on the profiling build: its wall time,
    then its phases' close times and preemptions. ``busy``: a spinning process per core
    meanwhile, so that the OS preempts the step's threads."""
    from enginecore import LLM, SamplingParams

    lib = _profiled()
    seen: list[tuple[float, list[float], list[int]]] = []
    with LLM(str(model), multiprocessing=False, max_model_len=128) as llm:
        runner = llm.collective_rpc(lambda w: w.model_runner)[0]
        step = runner.fused_decode
        assert step is not None
        layer_phases = 5 * len(runner.model.model.layers)
        close = (ctypes.c_double * (layer_phases + 3))()
        preempted = (ctypes.c_int32 * (layer_phases + 2))()
        fused = step.run

        def timed(ids: Any, positions: Any, batch: Any, **head: Any) -> Any:
            if ids.shape[0] != 1:
                return fused(ids, positions, batch, **head)
            phases = layer_phases + {"tokens": 2, "logits": 1}.get(head.get("head"), 0)
            step.lib = lib
            started = time.perf_counter()
            out = fused(ids, positions, batch, **head)
            took = time.perf_counter() - started
            assert lib.ecd_profile_phases(close, preempted, phases) == phases
            seen.append((took, list(close)[: phases + 1], list(preempted)[:phases]))
            return out

        step.run = timed
        spin = [sys.executable, "-c", "while True: pass"]
        spinners = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1) if busy]
        try:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            llm.generate([{"prompt_token_ids": list(range(3, 30))}], params, use_tqdm=False)
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
    return seen


def test_each_phase_closes_after_the_last_within_the_call(tiny_llama) -> None:
    seen = _timelines(tiny_llama, busy=False)
    assert len(seen) >= 30
    for took, close, preempted in seen:
        assert all(b >= a for a, b in itertools.pairwise(close))
        assert 0 < (close[-1] - close[0]) / 1e9 <= took
        assert min(preempted) >= 0


def test_preemptions_are_counted_in_the_phases_they_fell_in(tiny_llama) -> None:
    """With more busy threads than cores, some phases of some calls count preemptions
    (and no call's counts are left over for the next: each read clears them)."""
    seen = _timelines(tiny_llama, busy=True)
    counted = [sum(preempted) for _, _, preempted in seen]
    assert any(counted), "no preemption counted with every core busy"


def test_a_build_in_use_runs_its_own_kernels(tiny_llama) -> None:
    """``use_library``, as the benchmarks swap builds: the step's kernel addresses are the
    build's too (they are recorded at start, so a build's flags would otherwise reach the
    step's own code and not its kernels), BLAS's kept; its greedy tokens are the plain
    build's."""
    from enginecore import LLM, SamplingParams

    lib = _profiled()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 30))}]
    with LLM(str(tiny_llama), multiprocessing=False, max_model_len=128) as llm:
        plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        step = llm.collective_rpc(lambda w: w.model_runner)[0].fused_decode
        assert step is not None
        own = decode_step._kernels(lib, False, False, False)
        sgemm = step.model.k.sgemm
        step.use_library(lib)
        assert step.lib is lib
        for field in ("gemm_q4", "gemm_q8", "quantize_rows", "attend_span", "rms_norm"):
            assert getattr(step.model.k, field) == getattr(own, field) != 0
        plain_kernels = decode_step._kernels(decode_step._load(), False, False, False)
        assert step.model.k.gemm_q4 != plain_kernels.gemm_q4
        assert step.model.k.sgemm == sgemm
        steps = step.steps
        swapped = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert step.steps > steps
    assert swapped == plain
