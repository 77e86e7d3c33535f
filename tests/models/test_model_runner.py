"""The torch model runner driven by hand-built SchedulerOutputs, checked against transformers."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from enginecore import SamplingParams
from enginecore.scheduler_output import GrammarOutput
from enginecore_models.model_runner import TorchModelRunner
from tests.helpers.model_runner import PROMPTS, driver_for, make_runner


@functools.cache
def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt, max_new_tokens):
    model = _hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # random weights may pick EOS early
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_batch_with_chunked_prefill_equals_generate(arch, checkpoint_factory, model_refs):
    path = checkpoint_factory(arch)
    runner = make_runner(path, model_refs)
    driver = driver_for(runner, budget=16)
    for req_id, prompt in PROMPTS.items():
        driver.add(req_id, prompt, max_tokens=6)
    done = driver.run()
    for req_id, prompt in PROMPTS.items():
        assert done[req_id] == hf_greedy(path, prompt, 6), req_id
    assert runner.requests == {}  # finished requests were dropped


def test_preempted_request_resumes_with_same_tokens(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs, block_size=8)
    driver = driver_for(runner, budget=64)
    driver.add("p", PROMPTS["c"], max_tokens=8)
    driver.add("q", PROMPTS["b"], max_tokens=8)
    for _ in range(4):
        driver.step()
    driver.preempt("p")  # comes back as new, with its outputs so far
    done = driver.run()
    assert done["p"] == hf_greedy(tiny_llama, PROMPTS["c"], 8)
    assert done["q"] == hf_greedy(tiny_llama, PROMPTS["b"], 8)


def test_seeded_request_same_tokens_alone_or_batched(tiny_llama, model_refs):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8)

    def run(others):
        runner = make_runner(tiny_llama, model_refs)
        driver = driver_for(runner, budget=64)
        for i, prompt in enumerate(others):
            driver.add(f"other{i}", prompt, max_tokens=8, params=SamplingParams(temperature=1.0))
        driver.add("seeded", PROMPTS["b"], max_tokens=8, params=params)
        return driver.run()["seeded"]

    alone = run([])
    assert alone == run([PROMPTS["a"], PROMPTS["c"]])


def test_grammar_bitmask_restricts_tokens(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs)
    driver = driver_for(runner, budget=64)
    driver.add("g", PROMPTS["a"], max_tokens=2)
    driver.add("free", PROMPTS["b"], max_tokens=2)
    vocab = runner.hf_config.vocab_size
    bitmask = np.zeros((1, -(-vocab // 32)), dtype=np.int32)
    bitmask[0, 1] = 1 << 10  # only token 42
    grammar = GrammarOutput(structured_output_request_ids=["g"], grammar_bitmask=bitmask)
    out = driver.step(grammar)
    assert out.sampled_token_ids[out.req_id_to_index["g"]] == [42]
    assert out.sampled_token_ids[out.req_id_to_index["free"]] != [42]


def test_logprobs_rows_per_request(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs)
    driver = driver_for(runner, budget=64)
    driver.add("lp", PROMPTS["a"], max_tokens=1, params=SamplingParams(temperature=0.0, logprobs=2))
    driver.add("no", PROMPTS["b"], max_tokens=1)
    out = driver.step()
    i, j = out.req_id_to_index["lp"], out.req_id_to_index["no"]
    assert out.logprobs.logprob_token_ids[i][0] == out.sampled_token_ids[i][0]
    assert len(out.logprobs.logprob_token_ids[i]) == 3 and out.logprobs.sampled_token_ranks[i] == 1
    assert out.logprobs.logprob_token_ids[j] == []


def test_memory_sizing_and_sleep(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs, kv_cache_bytes=1 << 20)
    assert runner.get_max_model_len() == 512
    # 2 (K, V) x block 4 x 2 KV heads x head_dim 64 x 4 bytes x 4 layers
    assert runner.get_kv_cache_block_bytes() == 2 * 4 * 2 * 64 * 4 * 4
    assert runner.determine_available_memory() == 1 << 20
    runner.sleep(2)
    assert runner.kv_caches is None and runner.model is None
    runner.wake_up()
    driver = driver_for(runner, budget=64)
    driver.add("a", PROMPTS["a"], max_tokens=3)
    assert driver.run()["a"] == hf_greedy(tiny_llama, PROMPTS["a"], 3)


def test_plugin_registers_runner_and_models(model_refs):
    from enginecore.plugins import make_plugin_manager

    runners = make_plugin_manager(load_entrypoints=False).registry("model_runner")
    assert runners.get("torch") is TorchModelRunner
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"):
        assert arch in model_refs
