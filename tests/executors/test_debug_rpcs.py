"""The built-in debugging worker RPCs, and a plugin's own hooks installed by worker_started.

One real engine process with two tensor-parallel worker processes (``mp``): every RPC
answers once per rank, from that rank's process. A throwaway distribution on
``PYTHONPATH`` implements ``worker_started`` (wrapping the runner's ``execute_model`` in
every worker) and registers a worker RPC that reads what it counted.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from safetensors import safe_open

from enginecore import LLM, SamplingParams

PLUGIN_MODULE = textwrap.dedent(
    """
    import os

    import enginecore


    @enginecore.hookimpl
    def worker_started(worker):
        runner = worker.model_runner
        original = runner.execute_model
        worker.steps_seen = 0

        def counting(scheduler_output):
            worker.steps_seen += 1
            return original(scheduler_output)

        runner.execute_model = counting


    def steps_seen(worker):
        return {"rank": worker.rank, "pid": os.getpid(), "steps": worker.steps_seen}


    @enginecore.hookimpl
    def register_worker_rpcs(registry):
        registry.add("steps_seen", steps_seen)
    """
)


@pytest.fixture(scope="module")
def step_counter_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "enginecore_step_counter.py").write_text(PLUGIN_MODULE)
    info = site / "enginecore_step_counter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: enginecore-step-counter\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[enginecore]\nstep_counter = enginecore_step_counter\n")
    return site


@pytest.fixture(scope="module")
def tp2_llm(tiny_llama, step_counter_site, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        # The engine and worker processes inherit it and find the distribution.
        mp.setenv("PYTHONPATH", str(step_counter_site))
        mp.delenv("ENGINECORE_PLUGINS", raising=False)
        with LLM(
            tiny_llama,
            dtype="float32",
            tensor_parallel_size=2,
            executor="mp",
            num_blocks_override=64,
            max_model_len=512,
            trace_dir=str(tmp_path_factory.mktemp("traces")),
            trace_prompt_contents=True,
        ) as llm:
            yield llm


def checkpoint_shape(path: Path, name: str) -> list[int]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.get_slice(name).get_shape())


def test_memory_snapshot_per_rank(tp2_llm):
    snapshots = tp2_llm.collective_rpc("memory_snapshot")
    assert [s["rank"] for s in snapshots] == [0, 1]
    assert [s["tp_rank"] for s in snapshots] == [0, 1]
    assert snapshots[0]["pid"] != snapshots[1]["pid"]  # each answer comes from its own process
    for s in snapshots:
        assert s["device"]["type"] == "cpu"
        assert s["host"]["rss_bytes"] > 0
        assert s["host"]["system_total_bytes"] >= s["host"]["system_available_bytes"] > 0
        assert s["kv_cache_num_blocks"] == 64
        assert s["kv_cache_bytes"] > 0


def test_kv_cache_stats_match_the_cache_shape(tp2_llm):
    stats = tp2_llm.collective_rpc("kv_cache_stats")
    snapshots = tp2_llm.collective_rpc("memory_snapshot")
    for s, snap in zip(stats, snapshots, strict=True):
        # tiny llama: 4 layers, 2 KV heads split over 2 ranks, head_dim 64, block_size 16
        assert s["num_layers"] == 4
        assert s["layer_shape"] == [2, 64, 16, 1, 64]
        assert s["dtype"] == "float32"
        assert s["total_bytes"] == s["num_blocks"] * s["bytes_per_block"] == snap["kv_cache_bytes"]
        assert s["num_requests"] == 0 and s["num_blocks_in_use"] == 0 and s["usage"] == 0.0


def test_model_summary_shows_the_sharding(tp2_llm, tiny_llama):
    summaries = tp2_llm.collective_rpc("model_summary")
    o_proj_in = checkpoint_shape(tiny_llama, "model.layers.0.self_attn.o_proj.weight")[1]
    for rank, summary in enumerate(summaries):
        assert summary["rank"] == rank and summary["tp_size"] == 2
        assert summary["architectures"] == ["LlamaForCausalLM"]
        assert summary["parameters_by_dtype"] == {"float32": summary["num_parameters"]}
        layers = {layer["name"]: layer for layer in summary["layers"]}
        o_proj = layers["model.layers.0.self_attn.o_proj"]["parameters"]["weight"]
        assert o_proj["shape"][1] == o_proj_in // 2  # row-parallel: the input dim is split
        norm = layers["model.layers.0.input_layernorm"]["parameters"]["weight"]
        assert norm["shape"] == checkpoint_shape(
            tiny_llama, "model.layers.0.input_layernorm.weight"
        )
        assert (
            sum(layer["num_parameters"] for layer in summary["layers"])
            == (summary["num_parameters"])
        )


def test_trace_next_steps_records_scheduler_outputs_and_timings(tp2_llm, tmp_path):
    paths = tp2_llm.collective_rpc("trace_next_steps", args=(3,))
    assert len(set(paths)) == 2 and all("rank" in Path(p).name for p in paths)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    tp2_llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    per_rank = [[json.loads(line) for line in Path(p).read_text().splitlines()] for p in paths]
    for rank, lines in enumerate(per_rank):
        assert len(lines) == 3  # exactly n steps, then the tracer removes itself
        assert [line["step"] for line in lines] == [0, 1, 2]
        assert all(line["rank"] == rank for line in lines)
        assert all(line["execute_model_s"] > 0 for line in lines)
        assert all(line["sample_tokens_s"] is not None for line in lines)
        first = lines[0]["scheduler_output"]
        [new] = first["scheduled_new_reqs"]
        assert new["prompt_token_ids"] == [5, 6, 7, 8, 9]
        assert new["sampling_params"]["max_tokens"] == 6
        assert lines[0]["num_scheduled_tokens"] == 5
        assert [line["num_scheduled_tokens"] for line in lines[1:]] == [1, 1]
        step_ids = [line["step_id"] for line in lines]
        assert step_ids == sorted(step_ids) and len(set(step_ids)) == 3
    assert per_rank[0][0]["scheduler_output"] == per_rank[1][0]["scheduler_output"]


def test_trace_next_steps_rejects_a_bad_count(tp2_llm):
    with pytest.raises(Exception, match="positive step count"):
        tp2_llm.collective_rpc("trace_next_steps", args=(0,))


def test_worker_started_installs_a_plugins_hooks_in_every_worker(tp2_llm):
    before = tp2_llm.collective_rpc("steps_seen")
    tp2_llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))
    after = tp2_llm.collective_rpc("steps_seen")
    assert [a["rank"] for a in after] == [0, 1]
    assert len({a["pid"] for a in after}) == 2
    for b, a in zip(before, after, strict=True):
        assert a["steps"] - b["steps"] >= 3  # one prefill + two decodes at least
