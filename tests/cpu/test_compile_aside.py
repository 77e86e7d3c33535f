"""A start on a kernel cache without the libraries the steps call answers its first
requests before those libraries finish compiling: the fused kernels (norms, rotary,
attention) are served by torch and the many-row quantized products by the one-row
kernels' de-quantization until each library lands; between two steps it is taken up,
and the tokens stay the same (transformers' greedy tokens on the same file).

The engine runs in a process of its own (as a user's start), with ``$CC`` a wrapper that
holds every compile of ``cpu_kernels.c``, ``quant_gemm.c`` and ``decode_step.c`` until
the engine has answered; the blocks' one-row kernels are in the cache already (the first
product waits for them: see ``gguf_linear_method.blocks_linear``).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from enginecore_cpu import cpu_kernels, kquant_kernels, quant_kernels
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or quant_kernels.load() is None, reason="no C compiler"
)

HELD = ("cpu_kernels.c", "quant_gemm.c", "decode_step.c")

_HOLDING_CC = """\
#!{python}
import os, sys, time
if any(a.endswith({held!r}) for a in sys.argv[1:]):
    while os.path.exists({hold!r}):
        time.sleep(0.05)
# Builds that nothing waits for run niced or under SCHED_IDLE, which on a shared machine
# may wait long for an idle core: what is tested is that nothing waits, not their speed.
try:
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, 0)
except (AttributeError, OSError):
    pass
os.execvp("gcc", ["gcc", *sys.argv[1:]])
"""

# The engine's process: answers, says which libraries served, lets the compilers go,
# answers again once the libraries landed.
_ENGINE = """
import json, os, sys, time
from enginecore import LLM, SamplingParams
from enginecore_cpu import cpu_kernels, quant_gemm
path, hold, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(path, multiprocessing=False, max_model_len=256)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
def answer():
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
def report(stage, tokens):
    print(json.dumps({"stage": stage, "tokens": tokens,
        "cpu_kernels": cpu_kernels.library.loaded is not None,
        "quant_gemm": quant_gemm.library.loaded is not None}), flush=True)
report("while compiling", answer())
os.unlink(hold)
libraries = [cpu_kernels.build(only_path=True), quant_gemm.build(only_path=True)]
deadline = time.monotonic() + 600
while not all(p.exists() for p in libraries) and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(0.5)  # steps look for landed libraries at most every quarter second
llm.reset_prefix_cache()
report("landed", answer())
llm.shutdown()
"""

PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 12))]


def _line(process: subprocess.Popen[str], timeout: float) -> dict[str, object] | None:
    """The engine's next report, or None if it gave none in ``timeout`` seconds."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            line = process.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                return dict(json.loads(line))
        elif process.poll() is not None:
            return None
    return None


@pytest.mark.slow
def test_the_first_requests_do_not_wait_for_a_compiler(tiny_llama, tmp_path):
    gguf = write_gguf(tiny_llama, tmp_path / "q8.gguf", quantize=True)
    cache = tmp_path / "cache"
    (cache / "cpu_kernels").mkdir(parents=True)
    for build in (quant_kernels.build, kquant_kernels.build):
        shutil.copy(build(), cache / "cpu_kernels")
    hold = tmp_path / "hold"
    wrapper = tmp_path / "cc"
    wrapper.write_text(_HOLDING_CC.format(python=sys.executable, hold=str(hold), held=HELD))
    wrapper.chmod(0o755)
    hold.touch()
    env = dict(os.environ, ENGINECORE_CACHE_DIR=str(cache), CC=str(wrapper))
    process = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(gguf), str(hold), json.dumps(PROMPTS)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        first = _line(process, timeout=240)
        assert first is not None, "no answer while cpu_kernels.c and quant_gemm.c were held"
        assert first["stage"] == "while compiling"
        assert not first["cpu_kernels"] and not first["quant_gemm"]  # served without them
        landed = _line(process, timeout=600)
        assert landed is not None, "no answer after the libraries landed"
        assert landed["cpu_kernels"] and landed["quant_gemm"]  # taken up between steps
        for prompt, tokens, after in zip(PROMPTS, first["tokens"], landed["tokens"], strict=True):
            assert isinstance(tokens, list) and isinstance(after, list)
            reference = greedy_reference(gguf.parent, prompt, 8, gguf_file=gguf.name)
            assert_matches_reference(tokens, reference, "served while compiling")
            assert_matches_reference(after, reference, "once the libraries landed")
        assert landed["tokens"] == first["tokens"]
        assert process.wait(timeout=60) == 0
    finally:
        hold.unlink(missing_ok=True)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
