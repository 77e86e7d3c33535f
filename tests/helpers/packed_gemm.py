"""A CPU projection test run in a fresh interpreter (the GEMM backend is chosen at import)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


LOADED_MODEL = """
    import torch
    from enginecore import make_config
    from enginecore_cpu import packed_gemm
    from enginecore_models.model_runner import TorchModelRunner
    from enginecore.interfaces import WorkerSpec

    spec = WorkerSpec(
        worker_ref="enginecore_executors.worker:Worker",
        model_runner_ref="enginecore_models.model_runner:TorchModelRunner",
        model_refs={{"LlamaForCausalLM": "enginecore_models.models.llama:LlamaForCausalLM"}},
    )
    runner = TorchModelRunner(make_config(model="{path}", dtype="float32"), spec)
    runner.load_model()
    matrices = [(n, p) for n, p in runner.model.named_parameters() if p.dim() == 2]
    two_rows = lambda p: torch.ones(2, p.shape[1])
    packed = [(n, packed_gemm.packed_for(p, two_rows(p))) for n, p in matrices]
    gated = lambda w: " (gated)" if getattr(w, "half", 0) else ""
    print(",".join(n + gated(w) for n, w in packed if w is not None))
"""
