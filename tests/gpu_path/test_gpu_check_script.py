"""``benchmarks/gpu_check.py`` is known to run before a GPU is at hand: its arithmetic is
checked here, and ``--cpu-smoke`` runs every stage on the CPU with small shapes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.helpers.script_module import load_script

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _script():
    return load_script("benchmarks/gpu_check.py")


def test_the_bound_is_the_bytes_read_at_the_copy_bandwidth():
    """A copy of 1 GB moves 2 GB (read + write); the bandwidth counts both, so a step that
    reads 2 GB at that rate takes as long as the copy: no further halving."""
    check = _script()
    copy_seconds = 0.004
    bandwidth = 2 * 1e9 / copy_seconds
    assert check.decode_bound_s(1.5e9, 0.5e9, bandwidth) == pytest.approx(copy_seconds)


def test_the_1b_shape_is_llama_3_2_1b():
    """1.24 B parameters with the tied embedding, as the released model."""
    shape = _script().LLAMA_3_2_1B
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    total = layers * per_layer + shape["vocab_size"] * h + h
    assert 1.23e9 < total < 1.25e9


def test_transformers_dtype_argument_matches_the_installed_version():
    import torch
    import transformers
    from packaging.version import Version

    kwargs = _script().hf_dtype(torch.bfloat16)
    want = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    assert kwargs == {want: torch.bfloat16}


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["seconds"]) == {
        "parity",
        "block_linear",
        "int8_model",
        "throughput",
        "decode",
        "moe",
        "lora",
        "piecewise",
    }
    assert all(r["equal"] == r["of"] for r in report["parity"])
    assert [(r["batch"], r["cuda_graphs"]) for r in report["decode"]["rows"]] == [
        (1, True),
        (4, True),
        (1, False),
        (4, False),
    ]
    assert all(r["bound_ms"] > 0 and r["step_ms"] > 0 for r in report["decode"]["rows"])
    assert all(r["max_rel_diff"] < 1e-2 for r in report["block_linear"]["rows"])
    assert report["int8_model"]["layers_in_blocks"] > 0
    moe = report["moe"]
    assert moe["groupings"] == ["loop"] and moe["equal"] == moe["of"]
    assert "Decode steps (Llama-3.2-1B shape" in result.stdout
    assert [r["equal"] for r in report["lora"]] == [r["of"] for r in report["lora"]]
    assert [r["equal"] for r in report["piecewise"]] == [r["of"] for r in report["piecewise"]]
