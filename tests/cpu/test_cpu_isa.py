"""``ENGINECORE_CPU_ISA``: every kernel library the engine builds, built for the x86-64 level
it names (an AVX2 CPU's kernels on an AVX-512 one), and refused where it is no level or
one this CPU cannot run."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from enginecore.errors import ConfigError
from enginecore_cpu import bf16_gemv, cpu_kernels, kquant_kernels, quant_gemm, quant_kernels

ISA = "ENGINECORE_CPU_ISA"
# What keeps torch's own kernels (ATen, oneDNN, MKL) within AVX2, read as torch loads.
TORCH_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
x86_64 = platform.machine().lower() in ("x86_64", "amd64")
needs_v4 = pytest.mark.skipif(
    not x86_64
    or not {"avx512f", "avx512bw", "avx512vl"} <= set(cpu_kernels._cpu_signature().split()),
    reason="needs an AVX-512 (x86-64-v4) CPU to build below its own level",
)
needs_compiler = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler")
objdump = shutil.which("objdump")


def _wide_registers(library: Path) -> int:
    """How many instructions of ``library`` name an AVX-512 register (zmm, or a mask k1-k7)."""
    assert objdump is not None
    text = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True).stdout
    return sum("%zmm" in line or "{%k" in line for line in text.splitlines())


@needs_v4
def test_the_override_picks_the_level_and_none_of_the_cpus_extensions(monkeypatch):
    monkeypatch.setenv(ISA, "x86-64-v3")
    assert cpu_kernels.instruction_set() == "x86-64-v3"
    # an AVX2 CPU without AVX-VNNI: no VNNI build, no bfloat16 kernel, no AMX
    assert quant_kernels._vnni() is None
    assert not bf16_gemv.cpu_has_avx512_bf16() and not cpu_kernels.cpu_has_amx()
    names = [
        quant_kernels.build(only_path=True).name,
        kquant_kernels.build(only_path=True).name,
        quant_gemm.build(only_path=True).name,
        cpu_kernels.build(only_path=True).name,
    ]
    assert all("_x86-64-v3_" in name for name in names), names
    # this CPU's own level, named: the level alone, still without its VNNI
    monkeypatch.setenv(ISA, "x86-64-v4")
    assert quant_kernels.build(only_path=True).name.startswith(
        "enginecore_quant_kernels_x86-64-v4_"
    )


@needs_v4
@needs_compiler
@pytest.mark.skipif(objdump is None, reason="no objdump")
def test_the_library_built_for_avx2_has_no_avx512_instruction(monkeypatch):
    """The K-quant kernels (the smallest block library) built under the override: AVX2's
    256-bit registers, none of AVX-512's; the build for this CPU has them."""
    built = kquant_kernels.build()
    monkeypatch.setenv(ISA, "x86-64-v3")
    avx2 = kquant_kernels.build()
    assert avx2 != built and "_x86-64-v3_" in avx2.name
    assert _wide_registers(avx2) == 0
    assert _wide_registers(built) > 0  # the check sees AVX-512 where there is some


def test_the_torch_switches_are_the_ones_documented():
    assert cpu_kernels.TORCH_AVX2_SWITCHES == TORCH_AVX2


@pytest.mark.parametrize("value", ["avx2", "x86-64-v5", "v3", "native"])
def test_a_value_that_is_no_level_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(ISA, value)
    with pytest.raises(ConfigError, match=r"ENGINECORE_CPU_ISA=.*x86-64, x86-64-v2, x86-64-v3"):
        cpu_kernels.instruction_set()


@pytest.mark.skipif(not x86_64, reason="x86-64 levels")
def test_a_level_this_cpu_cannot_run_is_refused(monkeypatch):
    avx2_cpu = "flags : sse4_2 popcnt ssse3 avx avx2 fma bmi1 bmi2 f16c movbe"
    monkeypatch.setattr(cpu_kernels, "_cpu_signature", lambda: avx2_cpu)
    monkeypatch.setenv(ISA, "x86-64-v4")
    with pytest.raises(ConfigError, match="this CPU runs at most x86-64-v3"):
        cpu_kernels.instruction_set()
    monkeypatch.setenv(ISA, "x86-64-v2")
    assert cpu_kernels.instruction_set() == "x86-64-v2"


def test_unset_or_empty_is_this_cpus_level(monkeypatch):
    monkeypatch.setenv(ISA, "")
    detected = cpu_kernels.instruction_set()
    monkeypatch.delenv(ISA)
    assert detected == cpu_kernels.instruction_set()


# --- a whole engine under the override ------------------------------------------------------

_CHILD = r"""
import json, sys
import torch
from enginecore import LLM, SamplingParams
from enginecore_cpu import cpu_kernels, decode_step, quant_gemm, quant_kernels, kquant_kernels

# every library landed before the first step, as a warm kernel cache has them
for build in (cpu_kernels.build, decode_step.build, quant_gemm.build, quant_kernels.build,
              kquant_kernels.build):
    build()
prompt = list(range(3, 40))
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
with LLM(sys.argv[1], multiprocessing=False) as llm:
    tokens = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    steps = llm.collective_rpc(
        lambda w: getattr(w.model_runner.fused_decode, "steps", None))[0]
    high = {fmt: kquant_kernels.load().high(fmt) for fmt in ("Q5_K", "Q6_K")}
maps = open("/proc/self/maps").read().split()
libraries = sorted({p for p in maps if "/enginecore_" in p and p.endswith(".so")})
print(json.dumps({"tokens": list(tokens), "prompt": prompt, "libraries": libraries,
                  "torch": torch.backends.cpu.get_cpu_capability(), "steps": steps,
                  "high": high}))
"""


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: V and the down projection in Q6_K, the rest in Q4_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


def _q5_k_m(checkpoint: Path) -> Callable[[str], str]:
    """llama.cpp's Q5_K_M mix for ``checkpoint``'s layers (its head tied or not)."""
    from safetensors import safe_open

    from enginecore.testing.quantizers import q5_k_m_type

    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        tied = "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open has no __contains__)
    return lambda name: q5_k_m_type(name, layers, tied)


FILES: dict[str, Callable[[Path], Callable[[str], str]]] = {
    "Q4_0": lambda checkpoint: lambda name: "Q4_0",
    "Q8_0": lambda checkpoint: lambda name: "Q8_0",
    "Q4_K_M": lambda checkpoint: _q4_k_m,
    "Q5_K_M": _q5_k_m,
}


@needs_v4
@needs_compiler
@pytest.mark.skipif(objdump is None, reason="no objdump")
@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FILES))
def test_the_avx2_build_decodes_as_transformers(tiny_llama, tmp_path, fmt):
    """A GGUF file served under ``ENGINECORE_CPU_ISA=x86-64-v3`` with torch's own switches
    kept to AVX2: every enginecore library the process maps is the x86-64-v3 build (no
    AVX-512 instruction in it), the step runs fused, and the greedy tokens are what
    transformers' argmax is on the file, fed those tokens, up to the first step whose top
    two logits are within the activations' 8-bit rounding. Q4_K_M's and Q5_K_M's Q6_K rows
    and Q5_K_M's Q5_K rows are read with their high bits packed, the AVX2 build's layout."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.gguf_writer import write_gguf

    types = FILES[fmt](tiny_llama)
    path = write_gguf(tiny_llama, tmp_path / f"{fmt}.gguf", types=types)
    env = {**os.environ, ISA: "x86-64-v3", **TORCH_AVX2}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["torch"] == "AVX2"
    names = [Path(p).name for p in run["libraries"]]
    kinds = ["cpu_kernels", "decode_step", "quant_kernels"]
    kinds += ["kquant_kernels"] if fmt.endswith("_K_M") else []
    for kind in kinds:
        assert any(n.startswith(f"enginecore_{kind}_x86-64-v3_") for n in names), names
    assert run["high"] == {"Q5_K": "packed", "Q6_K": "packed"}
    assert all("_x86-64-v3_" in n for n in names), names
    assert all(_wide_registers(Path(p)) == 0 for p in run["libraries"])
    assert run["steps"] and run["steps"] >= 8, run["steps"]

    got, prompt = run["tokens"], run["prompt"]
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
    tol = 0.02 * float(logits.abs().max())
    top2 = logits.topk(2, -1).values
    first_tie = [*(top2[:, 0] - top2[:, 1] <= tol).tolist(), True].index(True)
    assert got[:first_tie] == logits.argmax(-1).tolist()[:first_tie], (first_tie, got)
    chosen = logits[torch.arange(len(got)), torch.tensor(got)]
    assert (top2[:, 0] - chosen <= tol).all()


@needs_v4
def test_torch_running_wider_than_the_level_is_named_once(monkeypatch, caplog):
    monkeypatch.setenv(ISA, "x86-64-v3")
    monkeypatch.setattr(cpu_kernels, "_warned_torch", set())
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        cpu_kernels.instruction_set()
        assert not caplog.records  # torch kept to AVX2: nothing to say
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        cpu_kernels.instruction_set()
        cpu_kernels.instruction_set()
    (record,) = caplog.records
    assert all(f"{k}={v}" in record.getMessage() for k, v in TORCH_AVX2.items())


@needs_v4
def test_a_chosen_level_keeps_its_own_prepared_weights_and_probe_verdicts(monkeypatch):
    from enginecore_cpu import prepared_weights, probe_cache

    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    own, verdicts = prepared_weights.cpu_identity(), probe_cache.path()
    monkeypatch.setenv(ISA, "x86-64-v3")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert prepared_weights.cpu_identity() != own
    assert probe_cache.path() != verdicts


@needs_v4
def test_a_chosen_level_keeps_k_quant_high_bits_in_its_own_layout_and_cache(monkeypatch, tmp_path):
    """Under ``ENGINECORE_CPU_ISA=x86-64-v3`` the engine reads Q5_K's and Q6_K's high bits
    packed (the AVX2 build's layout), on this CPU's own level as bit planes; the
    prepared-weight cache keys the layouts, so one CPU's entries written in one are never
    read in the other."""
    from enginecore_cpu import prepared_weights

    path = tmp_path / "file.gguf"
    path.write_bytes(b"GGUF")
    own = kquant_kernels.q5_high(), kquant_kernels.q6_high()
    directory = prepared_weights.PreparedWeights(path, cpu="a CPU").directory
    monkeypatch.setenv(ISA, "x86-64-v3")
    assert own == ("planes", "planes")
    assert (kquant_kernels.q5_high(), kquant_kernels.q6_high()) == ("packed", "packed")
    assert prepared_weights.PreparedWeights(path, cpu="a CPU").directory != directory


def test_the_cache_keys_q5_k_high_bits_apart_from_q6_k(monkeypatch, tmp_path):
    """A build whose Q5_K layout alone differs (Q6_K's the same) finds another
    prepared-weight directory: an entry with Q5_K in one layout is never served to
    kernels that read the other."""
    from enginecore_cpu import prepared_weights

    path = tmp_path / "file.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(kquant_kernels, "q5_high", lambda: "planes")
    monkeypatch.setattr(kquant_kernels, "q6_high", lambda: "packed")
    directory = prepared_weights.PreparedWeights(path, cpu="a CPU").directory
    monkeypatch.setattr(kquant_kernels, "q5_high", lambda: "packed")
    assert prepared_weights.PreparedWeights(path, cpu="a CPU").directory != directory
