"""``ModelRunnerContract``: what the engine expects of a model runner (and of a model).

Subclass it and point it at your runner, or at the torch runner with your model::

    from enginecore.testing import ModelRunnerContract

    class TestMyRunner(ModelRunnerContract):
        runner = "my-runner"              # a registered name, or the class

    class TestMyModel(ModelRunnerContract):
        runner = "torch"
        architecture = "MyLlamaForCausalLM"   # the tiny checkpoint is relabelled to it

A small scheduler stand-in drives the runner with real ``SchedulerOutput`` deltas (new
requests, cached requests with new blocks, chunked prefill, finished and preempted ids,
shuffled non-contiguous block tables) on a tiny random-weight checkpoint made offline.
The suite checks sizes, one sampled token per request whose known tokens are all
computed and none for a partial prefill chunk, greedy tokens equal to transformers',
batch-independence, and that preempted requests resume and finished ones are dropped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from enginecore.params import SamplingParams
from enginecore.scheduler_output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from enginecore.checkpoints import Arch

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
TIE_GAP = 1e-4


@dataclass
class _Req:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    sent: bool = False


class RunnerDriver:
    """A minimal scheduler: token budget, chunked prefill, shuffled block tables.

    ``add`` takes each request's sampling parameters (greedy by default); ``step`` takes
    the step's grammar bitmask, if any, and hands it to ``sample_tokens``.
    """

    def __init__(self, runner: Any, num_blocks: int, block_size: int, budget: int = 16) -> None:
        self.runner = runner
        self.block_size = block_size
        self.budget = budget
        self.free = list(range(1, num_blocks))
        random.Random(0).shuffle(self.free)
        self.reqs: dict[str, _Req] = {}
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        self.done: dict[str, list[int]] = {}
        self.step_id = 0

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 8,
        params: SamplingParams = GREEDY,
    ) -> None:
        self.reqs[req_id] = _Req(list(prompt), max_tokens, params)

    def preempt(self, req_id: str) -> None:
        req = self.reqs[req_id]
        self.free.extend(req.blocks)
        req.blocks, req.computed, req.sent = [], 0, False
        self.preempted.add(req_id)

    def step(self, grammar: GrammarOutput | None = None) -> Any:
        budget = self.budget
        new: list[NewRequestData] = []
        cached = CachedRequestData()
        num: dict[str, int] = {}
        for req_id, req in self.reqs.items():
            n = min(len(req.prompt) + len(req.outputs) - req.computed, budget)
            if n <= 0:
                continue
            need = -(-(req.computed + n) // self.block_size) - len(req.blocks)
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
        out = SchedulerOutput(
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
        result = self.runner.execute_model(out)
        if result is None:
            result = self.runner.sample_tokens(grammar)
        assert sorted(result.req_ids) == sorted(num), (
            f"the output lists {sorted(result.req_ids)}, the step scheduled {sorted(num)}"
        )
        for req_id, req in list(self.reqs.items()):
            if req_id not in num:
                continue
            tokens = result.sampled_token_ids[result.req_id_to_index[req_id]]
            due = req.computed == len(req.prompt) + len(req.outputs)
            assert len(tokens) == (1 if due else 0), (
                f"{req_id}: sampled {tokens} after computing {req.computed} of "
                f"{len(req.prompt) + len(req.outputs)} tokens (one token exactly when all "
                "known tokens are computed, none for a partial prefill chunk)"
            )
            req.outputs += tokens
            if len(req.outputs) >= req.max_tokens:
                self.finished.add(req_id)
                self.free.extend(req.blocks)
                del self.reqs[req_id]
                self.done[req_id] = req.outputs
        return result

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.reqs:
                self.step()  # tells the runner about the last finished requests
                return self.done
            self.step()
        raise AssertionError("requests did not finish")


class ModelRunnerContract:
    """Subclass and set ``runner`` (name or class); ``architecture`` for a model plugin."""

    runner: ClassVar[Any] = "torch"
    #: relabel the test checkpoint's ``architectures`` (a model plugin's registered name)
    architecture: ClassVar[str | None] = None
    #: the HF model type of the tiny checkpoint ("llama", "qwen2", "mistral", "gpt2")
    base_arch: ClassVar[Arch] = "llama"
    #: a checkpoint of your own instead of the tiny random one
    checkpoint: ClassVar[str | None] = None
    #: compare greedy tokens with transformers (needs a transformers-loadable checkpoint)
    compare_with_transformers: ClassVar[bool] = True
    num_blocks: ClassVar[int] = 256
    block_size: ClassVar[int] = 4
    config_overrides: ClassVar[dict[str, Any]] = {"dtype": "float32"}

    @pytest.fixture(scope="class")
    @classmethod
    def contract_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        if cls.checkpoint:
            return Path(cls.checkpoint)
        from enginecore.checkpoints import make_random_checkpoint

        root = tmp_path_factory.mktemp("runner-contract")
        path = Path(make_random_checkpoint(root / cls.base_arch, arch=cls.base_arch))
        if cls.architecture:
            config_path = path / "config.json"
            data = json.loads(config_path.read_text())
            data["architectures"] = [cls.architecture]
            config_path.write_text(json.dumps(data, indent=2))
        return path

    @classmethod
    def make_runner(cls, checkpoint: Path, **overrides: Any) -> Any:
        import torch

        from enginecore.config import make_config
        from enginecore.interfaces import ModelRunner, WorkerSpec
        from enginecore.plugins import make_plugin_manager

        config = make_config(
            model=str(checkpoint),
            block_size=cls.block_size,
            max_model_len=512,
            **{**cls.config_overrides, **overrides},
        )
        host = make_plugin_manager(config.plugins.enabled, config.plugins.disabled, strict=False)
        runners, models = host.registry("model_runner"), host.registry("model")
        runner_cls = runners.get(cls.runner) if isinstance(cls.runner, str) else cls.runner
        runner_ref = f"{runner_cls.__module__}:{runner_cls.__qualname__}"
        spec = WorkerSpec(
            worker_ref="enginecore_executors.worker:Worker",
            model_runner_ref=runner_ref,
            model_refs={name: models.entry(name).ref for name in models},
        )
        runner = runner_cls(config, spec, torch.device("cpu"))
        assert isinstance(runner, ModelRunner), "model runners subclass interfaces.ModelRunner"
        runner.load_model()
        runner.initialize_kv_cache(cls.num_blocks)
        return runner

    @pytest.fixture(scope="class")
    @classmethod
    def contract_runner(cls, contract_checkpoint: Path) -> Any:
        return cls.make_runner(contract_checkpoint)

    def driver(self, runner: Any, budget: int = 16) -> RunnerDriver:
        return RunnerDriver(runner, self.num_blocks, self.block_size, budget)

    @staticmethod
    def prompts() -> dict[str, list[int]]:
        rng = random.Random(1)
        return {
            f"p{i}": [rng.randrange(3, 1000) for _ in range(n)]
            for i, n in enumerate([5, 13, 1, 21])
        }

    # --- the contract ------------------------------------------------------------------

    def test_reports_its_sizes(self, contract_runner: Any) -> None:
        assert contract_runner.get_max_model_len() > 0
        assert contract_runner.get_kv_cache_block_bytes() > 0

    def test_determine_available_memory_is_positive(self, contract_checkpoint: Path) -> None:
        runner = self.make_runner(contract_checkpoint)
        assert runner.determine_available_memory() > 0

    def test_one_token_per_complete_request_none_for_a_partial_chunk(
        self, contract_runner: Any
    ) -> None:
        driver = self.driver(contract_runner, budget=8)  # the 21-token prompt is chunked
        for req_id, prompt in self.prompts().items():
            driver.add(req_id, prompt, max_tokens=4)
        done = driver.run()  # RunnerDriver.step asserts the per-step shape
        assert sorted(done) == sorted(self.prompts())
        assert all(len(tokens) == 4 for tokens in done.values())

    def test_greedy_matches_transformers(
        self, contract_runner: Any, contract_checkpoint: Path
    ) -> None:
        if not self.compare_with_transformers:
            pytest.skip("compare_with_transformers = False")
        import torch
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(
            str(contract_checkpoint), dtype=torch.float32
        )
        reference.eval()
        driver = self.driver(contract_runner)
        for req_id, prompt in self.prompts().items():
            driver.add(req_id, prompt, max_tokens=6)
        ours = driver.run()
        for req_id, prompt in self.prompts().items():
            with torch.inference_mode():
                out = reference.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=6,
                    min_new_tokens=6,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            expected = out.sequences[0, len(prompt) :].tolist()
            compare = len(expected)
            for step, scores in enumerate(out.scores):  # stop at a near-tie of random weights
                top2 = torch.topk(scores[0].float(), 2).values
                if float(top2[0] - top2[1]) < TIE_GAP:
                    compare = step
                    break
            assert ours[req_id][:compare] == expected[:compare], (
                f"{req_id}: runner {ours[req_id]} != transformers {expected}"
            )

    def test_batching_does_not_change_greedy_tokens(self, contract_runner: Any) -> None:
        batched = self.driver(contract_runner)
        for req_id, prompt in self.prompts().items():
            batched.add(req_id, prompt, max_tokens=5)
        together = batched.run()
        for req_id, prompt in self.prompts().items():
            alone = self.driver(contract_runner)
            alone.add(req_id, prompt, max_tokens=5)
            assert alone.run()[req_id] == together[req_id], req_id

    def test_preempted_request_resumes_where_it_was(self, contract_runner: Any) -> None:
        prompt = self.prompts()["p1"]
        plain = self.driver(contract_runner)
        plain.add("r", prompt, max_tokens=6)
        expected = plain.run()["r"]
        driver = self.driver(contract_runner)
        driver.add("r", prompt, max_tokens=6)
        while len(driver.reqs["r"].outputs) < 3:
            driver.step()
        driver.preempt("r")  # dropped by the runner, re-sent with its outputs so far
        assert driver.run()["r"] == expected

    def test_finished_request_ids_can_be_reused(self, contract_runner: Any) -> None:
        prompt = self.prompts()["p0"]
        first = self.driver(contract_runner)
        first.add("same-id", prompt, max_tokens=3)
        tokens = first.run()["same-id"]
        again = self.driver(contract_runner)
        again.add("same-id", prompt, max_tokens=3)
        assert again.run()["same-id"] == tokens
