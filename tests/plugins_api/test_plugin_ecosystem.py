"""Four third-party plugins written from docs/plugins.md alone, installed into a fresh venv.

A fair-share scheduling policy, an executor that times every ``collective_rpc``, a CSV
stat logger and worker RPCs (``tests/plugins/``) are pip-installed the way a user
installs them; each then runs end to end from one config file, configured through its
``[plugins.NAME]`` table.
"""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest

from tests.helpers.fresh_venv import FreshVenv

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (
    "enginecore-fair-share",
    "enginecore-timing-executor",
    "enginecore-csv-stats",
    "enginecore-worker-rpcs",
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> FreshVenv:
    venv = FreshVenv(tmp_path_factory.mktemp("ecosystem") / "venv")
    paths = " ".join(f"tests/plugins/{name}" for name in PACKAGES)
    result = venv.sh(f"pip install --quiet {paths}", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return venv


def run(venv: FreshVenv, tmp_path: Path, config: str, body: str) -> dict:
    """Run ``body`` in the venv with ``llm`` built from ``config``; returns its JSON line."""
    (tmp_path / "engine.toml").write_text(textwrap.dedent(config))
    script = tmp_path / "run.py"
    script.write_text(
        "import json\nfrom enginecore import LLM, SamplingParams\n"
        "llm = LLM(config_file='engine.toml')\n" + textwrap.dedent(body)
    )
    result = venv.sh("python run.py", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_plugin_passes_the_check(venv):
    result = venv.sh("enginecore plugins --check --json", cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    records = {r["name"]: r for r in json.loads(result.stdout)}
    for name in ("fair_share", "timing_executor", "csv_stats", "worker_rpcs"):
        assert records[name]["error"] is None
        assert [p for p in records[name]["problems"] if p["severity"] == "error"] == []


def test_fair_share_holds_each_tenant_to_its_share(venv, tiny_llama, tmp_path):
    config = f"""
        [model]
        path = "{tiny_llama}"
        [scheduler]
        policy = "tenant_cap"
        max_num_seqs = 8
        [plugins.fair_share]
        max_running_per_tenant = 1
    """
    body = """
        tenants = ["a", "a", "a", "b"]
        params = [SamplingParams(max_tokens=4, ignore_eos=True, extra={"tenant": t}) for t in tenants]
        outs = llm.generate(["one", "two", "three", "four"], params)
        print(json.dumps({
            "components": llm.engine_client.ready.components,
            "queued": [o.metrics["queued_time"] for o in outs],
        }))
        llm.shutdown()
    """
    got = run(venv, tmp_path, config, body)
    assert got["components"]["scheduling_policy"] == "tenant_cap (from fair_share)"
    a0, a1, a2, b0 = got["queued"]
    # Tenant a runs one request at a time; b is admitted beside a's first.
    assert a0 < a1 < a2 and b0 < a1


def test_the_timing_executor_wraps_the_one_its_settings_name(venv, tiny_llama, tmp_path):
    report = tmp_path / "rpc.jsonl"
    config = f"""
        [model]
        path = "{tiny_llama}"
        [parallel]
        executor = "timed"
        [plugins.timing_executor]
        inner = "uni"
        report_path = "{report}"
    """
    body = """
        llm.generate("hello", SamplingParams(max_tokens=3))
        print(json.dumps({"components": llm.engine_client.ready.components}))
        llm.shutdown()
    """
    got = run(venv, tmp_path, config, body)
    assert got["components"]["executor"] == "timed (from timing_executor)"
    calls = {line["method"]: line for line in map(json.loads, report.read_text().splitlines())}
    assert calls["execute_model"]["calls"] >= 3 and calls["execute_model"]["seconds"] > 0
    assert "initialize_cache" in calls


def test_the_csv_stat_logger_writes_one_row_per_request(venv, tiny_llama, tmp_path):
    path = tmp_path / "requests.csv"
    config = f"""
        [model]
        path = "{tiny_llama}"
        [observability]
        stat_loggers = ["csv"]
        [plugins.csv_stats]
        path = "{path}"
    """
    body = """
        params = SamplingParams(max_tokens=3, ignore_eos=True, extra={"user": "alice"})
        llm.generate(["hello", "world"], params)
        llm.shutdown()
        print(json.dumps({}))
    """
    run(venv, tmp_path, config, body)
    rows = list(csv.DictReader(path.open()))
    assert sorted(r["request_id"] for r in rows) == ["0", "1"]
    assert {(r["finish_reason"], r["num_generation_tokens"], r["user"]) for r in rows} == {
        ("length", "3", "alice")
    }


def test_worker_rpcs_answer_from_every_rank(venv, tiny_llama, tmp_path):
    config = f"""
        [model]
        path = "{tiny_llama}"
    """
    body = """
        print(json.dumps({
            "count": llm.collective_rpc("parameter_count"),
            "identity": llm.collective_rpc("rank_identity"),
        }))
        llm.shutdown()
    """
    got = run(venv, tmp_path, config, body)
    from safetensors.torch import load_file

    weights = load_file(str(tiny_llama / "model.safetensors"))
    total = sum(t.numel() for t in weights.values())
    tied = total - weights["lm_head.weight"].numel() if "lm_head.weight" in weights else total
    assert got["count"][0] in (total, tied)  # the checkpoint's weights, once each
    assert got["identity"] == [{"rank": 0, "device": "cpu", "tp": [0, 1], "model": str(tiny_llama)}]
