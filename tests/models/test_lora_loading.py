"""LoRA adapters are read off the busy loop: a slow read stalls nobody, a bad one fails
only the requests naming it.

The slow read is real: the adapter's ``adapter_model.safetensors`` is a FIFO, so the
workers' read blocks until the test writes the file's bytes into it. Meanwhile the
engine is stepped by hand and every step's tokens are counted: the base request gets a
token in every step, the adapter's request none, until the bytes are written; then the
adapter's tokens equal PEFT's.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time

import pytest
import torch

from enginecore import SamplingParams
from enginecore.config import make_config
from enginecore.engine.core import EngineCore
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRARequest
from enginecore.protocol import EngineCoreRequest
from enginecore.request import FinishReason

pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPT = [11, 523, 87, 1999, 4, 250, 31, 77, 908]
# Steps the engine takes while the adapter's bytes are held back.
STEPS_DURING_READ = 8
# Liveness only: a read still blocked this long means the engine itself is stuck.
RELEASE_AFTER_S = 120.0


@functools.lru_cache(maxsize=4)
def peft_tokens(base: str, adapter: str | None, prompt: tuple[int, ...]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.inference_mode():
        out = model.eval().generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> str:
    path = make_random_adapter(
        tiny_llama, tmp_path_factory.mktemp("lora") / "qv", r=8, target_modules=("q_proj",)
    )
    return str(path)


def engine(base, executor: str, tp: int = 1, **overrides) -> EngineCore:
    config = make_config(
        model=str(base),
        dtype="float32",
        executor=executor,
        tensor_parallel_size=tp,
        enable_lora=True,
        max_lora_rank=8,
        num_blocks_override=64,
        **{"max_loras": 2, **overrides},
    )
    return EngineCore(config)


def request(req_id: str, max_tokens: int, lora: LoRARequest | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=time.time(),
        lora_request=lora,
    )


class Stepper:
    """Steps an engine by hand; per request: tokens, finish reason, error."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.step = core.step_fn()
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, tuple[FinishReason, str | None]] = {}

    def __call__(self) -> dict[str, int]:
        """One step; the tokens each request got in it."""
        got: dict[str, int] = {}
        outputs, _ = self.step()
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                got[out.request_id] = got.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = (out.finish_reason, out.error)
        return got

    def until_done(self, req_ids: set[str]) -> None:
        while not req_ids <= set(self.finished):
            self()


def fifo_adapter(adapter: str, dest) -> tuple[str, bytes]:
    """A copy of ``adapter`` whose weights file is a FIFO; returns it and the bytes."""
    shutil.copytree(adapter, dest)
    weights = dest / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    os.mkfifo(weights)
    return str(dest), data


@pytest.mark.parametrize("executor", ["uni", pytest.param("mp", marks=pytest.mark.slow)])
def test_a_slow_adapter_read_stalls_no_other_request(tiny_llama, adapter, tmp_path, executor):
    path, data = fifo_adapter(adapter, tmp_path / "slow")
    released = threading.Event()
    released_early = threading.Event()

    def write_weights() -> None:
        # Blocks until the reader opens the FIFO, then hands it the file.
        if not released.wait(RELEASE_AFTER_S):
            released_early.set()  # the engine never stepped on without the adapter
        with open(path + "/adapter_model.safetensors", "wb") as fifo:
            fifo.write(data)

    writer = threading.Thread(target=write_weights, daemon=True)
    writer.start()
    core = engine(tiny_llama, executor)
    try:
        step = Stepper(core)
        core.add_request(request("base", 64))
        while not step.tokens.get("base"):
            step()
        lora = LoRARequest("slow", 1, path)
        core.add_request(request("lora", MAX_TOKENS, lora))
        during = [step() for _ in range(STEPS_DURING_READ)]
        assert not released_early.is_set(), "a step waited for the adapter's read"
        assert all(got.get("base") == 1 for got in during), during
        assert not step.tokens.get("lora") and "lora" not in step.finished
        released.set()
        step.until_done({"lora"})
        assert step.finished["lora"][0] == FinishReason.LENGTH
        assert step.tokens["lora"] == peft_tokens(str(tiny_llama), adapter, tuple(PROMPT))
        # The base request ran on throughout the read.
        assert "base" not in step.finished and len(step.tokens["base"]) > STEPS_DURING_READ
    finally:
        released.set()
        core.shutdown()
        writer.join(timeout=5)


def broken_adapter(adapter: str, dest) -> str:
    """A copy of ``adapter`` whose config passes every check of the header, but whose
    tensors do not have the rank the config says: only reading them finds out."""
    shutil.copytree(adapter, dest)
    config = dest / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 8', '"r": 4'))
    return str(dest)


@pytest.mark.parametrize(
    "executor,tp",
    [
        ("uni", 1),
        pytest.param("mp", 1, marks=pytest.mark.slow),
        pytest.param("mp", 2, marks=pytest.mark.slow),
    ],
)
def test_an_unreadable_adapter_fails_only_its_requests(tiny_llama, adapter, tmp_path, executor, tp):
    bad = LoRARequest("broken", 2, broken_adapter(adapter, tmp_path / "broken"))
    good = LoRARequest("good", 1, adapter)
    core = engine(tiny_llama, executor, tp)
    try:
        step = Stepper(core)
        core.add_request(request("base", MAX_TOKENS))
        core.add_request(request("bad-1", MAX_TOKENS, bad))
        core.add_request(request("good", MAX_TOKENS, good))
        core.add_request(request("bad-2", MAX_TOKENS, bad))
        step.until_done({"base", "bad-1", "good", "bad-2"})
        for req_id in ("bad-1", "bad-2"):
            reason, error = step.finished[req_id]
            assert reason == FinishReason.ERROR and not step.tokens.get(req_id)
            assert "'broken'" in error and bad.lora_path in error and "rank r=4" in error
        assert step.finished["base"][0] == step.finished["good"][0] == FinishReason.LENGTH
        base = str(tiny_llama)
        assert step.tokens["base"] == peft_tokens(base, None, tuple(PROMPT))
        assert step.tokens["good"] == peft_tokens(base, adapter, tuple(PROMPT))
        # The engine serves on, the broken adapter too once it is fixed on disk.
        shutil.rmtree(bad.lora_path)
        shutil.copytree(adapter, bad.lora_path)
        core.add_request(request("fixed", MAX_TOKENS, bad))
        step.until_done({"fixed"})
        assert step.tokens["fixed"] == peft_tokens(base, adapter, tuple(PROMPT))
    finally:
        core.shutdown()


def test_adapters_dropped_from_host_memory_are_read_again(tiny_llama, adapter, tmp_path):
    """One adapter kept read (``max_cpu_loras=1``), three taking turns: each new read
    drops the last one no request holds, and an adapter asked for again is read again;
    every request gets PEFT's tokens."""
    second = make_random_adapter(
        tiny_llama, tmp_path / "second", r=4, target_modules=("v_proj", "down_proj"), seed=5
    )
    loras = [LoRARequest("qv", 1, adapter), LoRARequest("second", 2, str(second))]
    core = engine(tiny_llama, "uni", max_loras=1, max_cpu_loras=1)
    try:
        step = Stepper(core)
        order = [0, 1, 0, 1]
        for i, which in enumerate(order):
            core.add_request(request(f"r{i}", MAX_TOKENS, loras[which]))
            step.until_done({f"r{i}"})
        runner = core.executor.worker.model_runner
        assert list(runner.lora.host) == [2]  # only the last one stays read
        base = str(tiny_llama)
        for i, which in enumerate(order):
            assert step.tokens[f"r{i}"] == peft_tokens(base, loras[which].lora_path, tuple(PROMPT))
    finally:
        core.shutdown()
