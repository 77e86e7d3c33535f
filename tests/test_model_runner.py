"""The torch model runner driven by hand-built SchedulerOutputs, checked against transformers."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from enginecore import SamplingParams, make_config
from enginecore.builtin_models.model_runner import TorchModelRunner
from enginecore.interfaces import WorkerSpec
from enginecore.scheduler_output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def make_runner(path, model_refs, *, block_size=4, num_blocks=256, **overrides):
    config = make_config(
        model=str(path), dtype="float32", block_size=block_size, max_model_len=512, **overrides
    )
    spec = WorkerSpec(
        worker_ref="enginecore.builtin_executors.worker:Worker",
        model_runner_ref="enginecore.builtin_models.model_runner:TorchModelRunner",
        model_refs=model_refs,
    )
    runner = TorchModelRunner(config, spec, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


@dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False  # the runner holds it


class Driver:
    """A minimal stand-in for the scheduler: token budget, chunked prefill, block tables.

    Blocks come from a shuffled free list so block tables are never contiguous.
    """

    def __init__(self, runner: TorchModelRunner, budget: int = 16, seed: int = 0) -> None:
        self.runner = runner
        self.budget = budget
        self.bs = runner.block_size
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.step_id = 0
        self.done: dict[str, list[int]] = {}

    def add(self, req_id, prompt, params=GREEDY, max_tokens=8):
        self.reqs[req_id] = _Req(list(prompt), params, max_tokens)

    def preempt(self, req_id):
        req = self.reqs[req_id]
        self.free.extend(req.blocks)
        req.blocks, req.computed, req.sent = [], 0, False
        self.preempted.add(req_id)

    def step(self, grammar=None):
        budget = self.budget
        new, cached, num = [], CachedRequestData(), {}
        for req_id, req in self.reqs.items():
            total = len(req.prompt) + len(req.outputs)
            n = min(total - req.computed, budget)
            if n <= 0:
                continue
            need = -(-(req.computed + n) // self.bs) - len(req.blocks)
            fresh = [self.free.pop() for _ in range(need)]
            req.blocks += fresh
            if not req.sent:
                new.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=req.prompt,
                        sampling_params=req.params,
                        block_ids=list(req.blocks),
                        num_computed_tokens=req.computed,
                        output_token_ids=list(req.outputs),
                    )
                )
                req.sent = True
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(fresh or None)
                cached.num_computed_tokens.append(req.computed)
            num[req_id] = n
            req.computed += n
            budget -= n
        so = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()),
            finished_req_ids=self.finished,
            preempted_req_ids=self.preempted,
            structured_output_request_ids=grammar.structured_output_request_ids if grammar else [],
            step_id=self.step_id,
        )
        self.finished, self.preempted = set(), set()
        self.step_id += 1
        assert self.runner.execute_model(so) is None
        out = self.runner.sample_tokens(grammar)
        assert sorted(out.req_ids) == sorted(num)
        for req_id, idx in out.req_id_to_index.items():
            req = self.reqs[req_id]
            tokens = out.sampled_token_ids[idx]
            total = len(req.prompt) + len(req.outputs)
            assert len(tokens) == (1 if req.computed == total else 0)
            req.outputs += tokens
            if len(req.outputs) >= req.max_tokens:
                self.finished.add(req_id)
                self.free.extend(req.blocks)
                del self.reqs[req_id]
                self.done[req_id] = req.outputs
        return out

    def run(self):
        while self.reqs:
            self.step()
        self.step()  # tells the runner about the last finished requests
        return self.done


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


PROMPTS = {"a": list(range(3, 8)), "b": list(range(100, 117)), "c": [7, 300, 42] * 10}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_batch_with_chunked_prefill_equals_generate(arch, checkpoint_factory, model_refs):
    path = checkpoint_factory(arch)
    runner = make_runner(path, model_refs)
    driver = Driver(runner, budget=16)
    for req_id, prompt in PROMPTS.items():
        driver.add(req_id, prompt, max_tokens=6)
    done = driver.run()
    for req_id, prompt in PROMPTS.items():
        assert done[req_id] == hf_greedy(path, prompt, 6), req_id
    assert runner.requests == {}  # finished requests were dropped


def test_preempted_request_resumes_with_same_tokens(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs, block_size=8)
    driver = Driver(runner, budget=64)
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
        driver = Driver(runner, budget=64)
        for i, prompt in enumerate(others):
            driver.add(f"other{i}", prompt, SamplingParams(temperature=1.0), max_tokens=8)
        driver.add("seeded", PROMPTS["b"], params, max_tokens=8)
        return driver.run()["seeded"]

    alone = run([])
    assert alone == run([PROMPTS["a"], PROMPTS["c"]])


def test_grammar_bitmask_restricts_tokens(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs)
    driver = Driver(runner, budget=64)
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
    driver = Driver(runner, budget=64)
    driver.add("lp", PROMPTS["a"], SamplingParams(temperature=0.0, logprobs=2), max_tokens=1)
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
    driver = Driver(runner, budget=64)
    driver.add("a", PROMPTS["a"], max_tokens=3)
    assert driver.run()["a"] == hf_greedy(tiny_llama, PROMPTS["a"], 3)


def test_plugin_registers_runner_and_models(model_refs):
    from enginecore.plugins import make_plugin_manager

    runners = make_plugin_manager(load_entrypoints=False).registry("model_runner")
    assert runners.get("torch") is TorchModelRunner
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"):
        assert arch in model_refs
