"""``enginecore bench compare``: its arguments, its result, its table and its plot.

The fast tests need no peer installed: they parse arguments, and build the result, the
table and the plot from runner outputs recorded in the shape ``benchmarks/peers/harness.py``
writes. The slow test runs the real thing with enginecore and transformers (our own venv's
transformers standing in for ``$PEERS/transformers-venv``) on the tiny checkpoint.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from enginecore.bench import compare

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_peers_parse_in_order_without_repeats():
    assert parse("m", "--peers", "transformers,vllm,transformers").peers == [
        "transformers",
        "vllm",
    ]


def test_unknown_peer_is_named(capsys):
    with pytest.raises(SystemExit):
        parse("m", "--peers", "vllm,tgi")
    err = capsys.readouterr().err
    assert "tgi" in err and "llamacpp" in err


@pytest.mark.parametrize(
    ("flag", "value"), [("--batch-sizes", "1,x"), ("--batch-sizes", "0"), ("--request-rates", "-1")]
)
def test_bad_lists_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        parse("m", flag, value)
    assert value in capsys.readouterr().err


def test_lists_parse():
    args = parse("m", "--batch-sizes", "1,8,64", "--request-rates", "2,inf")
    assert args.batch_sizes == [1, 8, 64]
    assert args.request_rates == [2.0, float("inf")]


def test_serving_refuses_peers_without_a_server():
    args = parse("m", "--workload", "serving", "--peers", "vllm,transformers")
    with pytest.raises(SystemExit, match="no serving workload for transformers"):
        compare.check_args(args)


def test_llamacpp_needs_a_gguf():
    with pytest.raises(SystemExit, match="--gguf"):
        compare.check_args(parse("m", "--peers", "llamacpp"))


def test_lengths_must_fit_the_model_length():
    with pytest.raises(SystemExit, match="max-model-len"):
        compare.check_args(parse("m", "--input-len", "400", "--output-len", "200"))


def test_a_missing_peer_venv_names_its_install_script(tmp_path):
    args = parse("m", "--peers-dir", str(tmp_path))
    with pytest.raises(SystemExit, match=r"install_vllm\.sh"):
        compare.interpreter("vllm", args)
    args = parse("m", "--python", f"vllm={sys.executable}")
    assert compare.interpreter("vllm", args) == sys.executable
    assert compare.interpreter("enginecore", args) == sys.executable


def test_every_system_has_its_runner_and_install_script():
    for system in (compare.OURS, *compare.PEERS):
        assert (compare.PEERS_DIR_IN_REPO / f"run_{system}.py").is_file()
    for _, installer in compare.PEER_VENVS.values():
        assert (compare.PEERS_DIR_IN_REPO / installer).is_file()


def test_turns_rotate_so_no_system_always_goes_first():
    systems = ["enginecore", "vllm", "transformers"]
    firsts = {compare.turn_order(systems, r)[0] for r in range(3)}
    assert firsts == set(systems)
    assert sorted(compare.turn_order(systems, 1)) == sorted(systems)


def test_prompts_are_seeded_and_avoid_special_ids():
    a = compare.random_prompts(4, 16, 1000, seed=3)
    assert a == compare.random_prompts(4, 16, 1000, seed=3)
    assert a != compare.random_prompts(4, 16, 1000, seed=4)
    assert all(256 <= t < 1000 for p in a for t in p) and all(len(p) == 16 for p in a)


def _turn(version: str, walls: dict[int, list[float]], output_len: int = 128) -> dict:
    """A runner's output, in the shape benchmarks/peers/harness.py writes."""
    return {
        "version": version,
        "startup_s": 1.0,
        "peak_rss_mib": 500.0,
        "points": [
            {"batch_size": b, "rep_walls_s": w, "output_tokens": b * output_len}
            for b, w in walls.items()
        ],
    }


RECORDED_TURNS = {
    "enginecore": [_turn("0.1.0", {1: [1.0], 16: [2.0]}), _turn("0.1.0", {1: [3.0], 16: [2.0]})],
    "vllm": [_turn("0.32.0", {1: [2.0], 16: [4.0]}), _turn("0.32.0", {1: [2.0], 16: [4.0]})],
}


def test_result_takes_the_median_over_turns_and_the_ratio(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["enginecore", "bench", "compare", "m", "--peers", "vllm"])
    args = parse("m", "--peers", "vllm", "--batch-sizes", "1,16")
    result = compare.build_result(args, RECORDED_TURNS)
    assert set(result) == {
        "workload",
        "machine",
        "command",
        "settings",
        "systems",
        "summary",
        "ratios",
    }
    assert result["command"] == "enginecore bench compare m --peers vllm"
    assert result["systems"]["vllm"]["version"] == "0.32.0"
    ours = {p["batch_size"]: p for p in result["summary"]["enginecore"]}
    assert ours[1]["wall_s"] == 2.0 and ours[1]["output_tok_s"] == 64.0
    assert ours[16]["output_tok_s"] == 16 * 128 / 2.0
    ratio = {p["batch_size"]: p["ours_over_peer"] for p in result["ratios"]["output_tok_s"]["vllm"]}
    assert ratio == {1: 1.0, 16: 2.0}
    json.dumps(result)  # the result is plain JSON

    table = compare.markdown_table(result).splitlines()
    assert table[0] == "| batch | enginecore out tok/s | vllm | ratio |"
    assert table[2] == "| 1 | 64 | 64 | 1.00 |"
    assert table[3] == "| 16 | 1,024 | 512 | 2.00 |"


def test_serving_summary_and_ratios():
    def point(rate, ttft, tpot, tput):
        return {"request_rate": rate, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
                "p50_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot, "output_throughput": tput}  # fmt: skip

    turns = {
        "enginecore": [
            {"ready_s": 5, "points": [point(2.0, 30, 5, 250), point(8.0, 40, 6, 900)]},
            {"ready_s": 5, "points": [point(2.0, 50, 7, 250), point(8.0, 40, 6, 1100)]},
        ],
        "vllm": [{"ready_s": 30, "points": [point(2.0, 20, 8, 250), point(8.0, 80, 12, 800)]}],
    }
    summary = compare.summarize_serving(turns)
    ours = {p["request_rate"]: p for p in summary["enginecore"]}
    assert ours[2.0]["p50_ttft_ms"] == 40 and ours[8.0]["output_throughput"] == 1000
    tpot = compare.ratios(summary, "request_rate", "p50_tpot_ms")["vllm"]
    assert [p["ours_over_peer"] for p in tpot] == [6 / 8, 0.5]


def test_the_plot_is_drawn_from_a_recorded_json_by_the_cli(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(sys, "argv", ["enginecore", "bench", "compare", "m"])
    result = compare.build_result(parse("m", "--batch-sizes", "1,16"), RECORDED_TURNS)
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps(result))
    plot = tmp_path / "plot.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "enginecore.cli",
            "bench",
            "compare",
            "--from-json",
            str(recorded),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "| 16 | 1,024 | 512 | 2.00 |" in done.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000


def test_runner_refuses_a_short_output(tmp_path):
    """The harness checks every system produced exactly the tokens asked for."""
    sys.path.insert(0, str(compare.PEERS_DIR_IN_REPO))
    try:
        import harness
    finally:
        sys.path.remove(str(compare.PEERS_DIR_IN_REPO))

    def load(spec):
        # A system that stops one token early on every batch (as one honouring EOS would).
        return "x", lambda prompts, n: len(prompts) * n - 1, lambda: None

    spec = {"prompts": [[300] * 4] * 2, "output_len": 3, "batch_sizes": [2], "reps": 1}
    with pytest.raises(RuntimeError, match="5 output tokens, expected 6"):
        harness.measure(spec, load)


@pytest.mark.slow
def test_compare_runs_ours_and_transformers_alternately(tiny_llama, tmp_path):
    out, plot = tmp_path / "result.json", tmp_path / "plot.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "enginecore.cli",
            "bench",
            "compare",
            str(tiny_llama),
            "--peers",
            "transformers",
            "--python",
            f"transformers={sys.executable}",
            "--batch-sizes",
            "1,4",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--rounds",
            "2",
            "--output-json",
            str(out),
            "--plot",
            str(plot),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["systems"]) == {"enginecore", "transformers"}
    for system in ("enginecore", "transformers"):
        assert len(result["systems"][system]["turns"]) == 2
        points = result["summary"][system]
        assert [p["batch_size"] for p in points] == [1, 4]
        assert all(p["output_tok_s"] > 0 and p["runs"] == 2 for p in points)
    assert [p["batch_size"] for p in result["ratios"]["output_tok_s"]["transformers"]] == [1, 4]
    # the second round starts with the system that went last in the first
    assert done.stdout.index("round 2/2: transformers") < done.stdout.index("round 2/2: enginecore")
    assert plot.stat().st_size > 10_000


def test_demo_names_the_demo_models_gguf():
    from enginecore.checkpoints import DEMO_GGUF_NAME

    args = parse("m", "--peers", "llamacpp", "--gguf", "demo")
    compare.resolve_demo(args)
    assert pathlib.Path(args.gguf).name == DEMO_GGUF_NAME and pathlib.Path(args.gguf).is_file()
    assert args.model == "m"


def test_prompts_for_a_gguf_model_use_its_vocabulary(tiny_llama, tmp_path):
    """enginecore can run the same GGUF file as llama.cpp: the prompts' vocabulary then
    comes from the file's tokenizer, as from config.json for a HF checkpoint."""
    from tests.helpers.gguf_writer import write_gguf

    gguf_file = write_gguf(pathlib.Path(tiny_llama), tmp_path / "tiny.gguf")
    config = json.loads((pathlib.Path(tiny_llama) / "config.json").read_text())
    assert compare.vocab_size(str(gguf_file)) == config["vocab_size"]
    assert compare.vocab_size(str(tiny_llama)) == config["vocab_size"]
