"""A GGUF's first load into a new kernel cache does not wait for the fused decode step's
library: the engine comes up and answers with the layers while ``decode_step.c``
compiles, then runs its decode steps fused once the library lands, with the same tokens.

The compiler is ``$CC``, a wrapper that holds ``decode_step.c``'s compile until the test
lets it go; the other libraries are copied into the new cache as built, so that only the
fused step's library is missing.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import pytest

from enginecore_cpu import cpu_kernels, decode_step, kquant_kernels, quant_gemm, quant_kernels
from tests.helpers.gguf_writer import write_gguf

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or quant_kernels.load() is None, reason="no C compiler"
)

_HOLDING_CC = """\
#!{python}
import os, sys, time
if any(a.endswith("decode_step.c") for a in sys.argv[1:]):
    open({held!r}, "w").close()
    while os.path.exists({hold!r}):
        time.sleep(0.05)
# Idle builds compile under SCHED_IDLE, which on a shared machine may wait long for an
# idle core: what is tested here is that nothing waits for the build, not how fast it is.
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
except (AttributeError, OSError):
    pass
os.execvp("gcc", ["gcc", *sys.argv[1:]])
"""

PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 12))]


@pytest.mark.slow
def test_the_first_token_does_not_wait_for_the_fused_step(tiny_llama, tmp_path, monkeypatch):
    from enginecore import LLM, SamplingParams

    gguf = write_gguf(tiny_llama, tmp_path / "q4.gguf", types=lambda name: "Q4_1")
    cache = tmp_path / "cache"
    (cache / "cpu_kernels").mkdir(parents=True)
    for build in (cpu_kernels.build, quant_kernels.build, kquant_kernels.build, quant_gemm.build):
        shutil.copy(build(), cache / "cpu_kernels")
    hold, held = tmp_path / "hold", tmp_path / "held"
    wrapper = tmp_path / "cc"
    wrapper.write_text(_HOLDING_CC.format(python=sys.executable, hold=str(hold), held=str(held)))
    wrapper.chmod(0o755)
    hold.touch()
    monkeypatch.setenv("ENGINECORE_CACHE_DIR", str(cache))
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(decode_step, "_lib", None)  # as in a new process
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    engine: list[LLM] = []
    start = threading.Thread(
        target=lambda: engine.append(LLM(str(gguf), multiprocessing=False)), daemon=True
    )
    start.start()
    try:
        start.join(timeout=180)
        assert engine, "the engine waited for the held decode-step library"
        llm = engine[0]
        library = decode_step.build(only_path=True)
        assert not library.exists()  # the engine is up without it

        def fused_steps() -> int:
            return int(llm.collective_rpc(lambda w: w.model_runner.fused_decode.steps)[0])

        layered = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert fused_steps() == 0  # every step served by the layers

        deadline = time.monotonic() + 300
        while not held.exists():  # its build was started, and has reached decode_step.c
            assert time.monotonic() < deadline, "the decode-step library was never built"
            time.sleep(0.2)
        hold.unlink()
        while not library.exists():
            assert time.monotonic() < deadline, "the decode-step library never landed"
            time.sleep(0.2)
        time.sleep(0.5)  # a step looks for it at most every quarter second
        llm.reset_prefix_cache()
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert fused_steps() >= 10  # the decode steps now ran fused
        # with the LM head and the greedy argmax in the call, as a step made at start does
        head_steps = llm.collective_rpc(lambda w: w.model_runner.fused_decode.step.token_steps)
        assert head_steps[0] >= 9, head_steps
        assert fused == layered
        llm.shutdown()
    finally:
        hold.unlink(missing_ok=True)
