"""`enginecore bench throughput` end to end on a tiny checkpoint, transformers included."""

from __future__ import annotations

import json

import pytest

from enginecore.cli import main


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_bench_throughput_reports_the_median_of_its_repetitions(tiny_llama, tmp_path, capsys):
    result_file = tmp_path / "throughput.json"
    argv = ["bench", "throughput", str(tiny_llama), "--num-prompts", "3", "--input-len", "8"]
    argv += ["--output-len", "5", "--hf-batch", "2", "--reps", "3"]
    argv += ["--engine-arg", "max_model_len=64", "--output-json", str(result_file)]
    assert main(argv) == 0
    results = json.loads(result_file.read_text())
    for system in ("enginecore", "transformers"):
        r = results[system]
        walls = r["rep_walls_s"]
        assert len(walls) == 3 and all(w > 0 for w in walls)
        assert r["wall_s"] == sorted(walls)[1]
        assert r["output_tokens"] == 15
        assert r["output_tok_s"] == r["output_tokens"] / r["wall_s"]
    assert results["ratio_output_tok_s"] > 0
    assert "median of 3 runs" in capsys.readouterr().out
