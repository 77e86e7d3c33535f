"""Bad input gets a clear error before anything is scheduled, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from enginecore import LLM, InvalidRequestError, SamplingParams
from enginecore.errors import ConfigError, EngineCoreError, UnknownComponentError


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, dtype="float32", multiprocessing=False, max_model_len=256) as llm:
        yield llm


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_k": -5}, "top_k must be"),
        ({"n": 0}, "n must be >= 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_params_are_rejected_at_construction(kwargs, needle) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_before_any_is_scheduled(llm) -> None:
    engine = llm.engine_client.engine
    ok = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ({"prompt_token_ids": [9] * 256}, "max_model_len is 256"),
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
        ({"text": "hi"}, "needs 'prompt'"),
        (3.14, "a prompt is a str"),
    ]
    for bad, needle in cases:
        with pytest.raises(InvalidRequestError, match=needle):
            llm.generate([ok, bad], SamplingParams(max_tokens=2))
        # The good prompt before the bad one was not scheduled either.
        assert engine.scheduler.get_num_unfinished_requests() == 0
    out = llm.generate(ok, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_mismatched_params_list(llm) -> None:
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_max_tokens_is_capped_by_max_model_len(llm) -> None:
    out = llm.generate(
        {"prompt_token_ids": [7] * 250}, SamplingParams(max_tokens=100, ignore_eos=True)
    )[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_the_registered_ones(tiny_llama, tmp_path) -> None:
    path = _copy_checkpoint(tiny_llama, tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineCoreError) as info:
        LLM(path, dtype="float32", multiprocessing=False)
    message = str(info.value)
    assert "FancyNewForCausalLM" in message
    for known in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"):
        assert known in message


def test_missing_weight_tensors_are_named(tiny_llama, tmp_path) -> None:
    path = _copy_checkpoint(tiny_llama, tmp_path / "model")
    weights = load_file(path / "model.safetensors")
    missing = sorted(name for name in weights if "layers.1.self_attn.q_proj" in name)
    for name in missing:
        del weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EngineCoreError) as info:
        LLM(path, dtype="float32", multiprocessing=False)
    assert "layers.1.self_attn.q_proj" in str(info.value)


def test_unloadable_tokenizer_is_a_clear_config_error(tiny_llama, tmp_path) -> None:
    path = _copy_checkpoint(tiny_llama, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="could not load a tokenizer"):
        LLM(path, dtype="float32", multiprocessing=False)


def test_unloadable_tokenizer_stops_the_engine_started_beside_it(tiny_llama, tmp_path) -> None:
    # With the engine in its own process the tokenizer loads while that process starts:
    # the tokenizer's error still wins, and the engine process does not outlive it.
    import psutil

    path = _copy_checkpoint(tiny_llama, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="could not load a tokenizer"):
        LLM(path, dtype="float32", multiprocessing=True)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_missing_model_path(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(tmp_path / "nowhere", multiprocessing=False)


def test_unknown_component_names_fail_at_startup_listing_alternatives(tiny_llama) -> None:
    with pytest.raises(
        UnknownComponentError, match=r"unknown scheduling policy 'lifo'.*fcfs.*priority"
    ):
        LLM(tiny_llama, scheduling_policy="lifo", multiprocessing=False)
    with pytest.raises(UnknownComponentError, match="unknown executor 'warp'"):
        LLM(tiny_llama, executor="warp", multiprocessing=False)
    with pytest.raises(UnknownComponentError, match="unknown model runner 'jax'"):
        LLM(tiny_llama, runner="jax", multiprocessing=False)
