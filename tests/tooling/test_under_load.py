"""``benchmarks/under_load.py``: its variants' environments, its arguments, its table, and
that its busy processes are gone when it stops."""

from __future__ import annotations

import psutil
import pytest

from tests.helpers.script_module import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/under_load.py")


def test_variants_replace_the_callers_openmp_settings(bench):
    base = {"PATH": "/bin", "OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "7"}
    assert bench.variant_env("default", base) == {"PATH": "/bin"}
    assert bench.variant_env("passive", base) == {"PATH": "/bin", "OMP_WAIT_POLICY": "passive"}
    assert bench.variant_env("spin:1000", base) == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}


@pytest.mark.parametrize("bad", ["spin", "spin:x", "lazy"])
def test_an_unknown_variant_stops_before_anything_runs(bench, bad):
    with pytest.raises(ValueError, match="unknown variant"):
        bench.parse_args(["--variants", f"default,{bad}"])


def test_arguments(bench):
    args = bench.parse_args(["m.gguf", "--busy", "0,2", "--variants", "passive,spin:10"])
    assert args.busy == [0, 2] and args.variants == ["passive", "spin:10"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--busy", "-1"])


def test_busy_processes_are_stopped(bench):
    procs = bench.start_busy(2)
    pids = [p.pid for p in procs]
    bench.stop_busy(procs)
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )


def test_table_has_a_row_per_variant_and_busy_count(bench):
    row = {"prefill_ms": 100.0, "prefill_cpu_ms": 150.0, "decode_tok_s": 50.0, "batch_tok_s": 200.0}
    results = {("passive", 1): [row, row], ("default", 1): [row], ("passive", 0): [row]}
    text = bench.table(results, {0: [0.5], 1: [1.2, 1.6]})
    lines = text.splitlines()
    assert lines[0].startswith("| busy | load avg | variant |")
    assert lines[2] == "| 0 | 0.5-0.5 | passive | 100.0 | 150.0 | 50.0 | 200.0 |"
    assert lines[3:] == [
        "| 1 | 1.2-1.6 | default | 100.0 | 150.0 | 50.0 | 200.0 |",
        "| 1 | 1.2-1.6 | passive | 100.0 | 150.0 | 50.0 | 200.0 |",
    ]
