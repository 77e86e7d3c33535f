"""On a CPU the model runner hands its step arrays to the model as they are (the host
staging copy is a GPU's, ``StagingBuffer(stage_on_host=...)``): the greedy tokens must be
those of the staged path, and transformers' greedy ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import enginecore_models.model_runner as model_runner_module
from enginecore.staging import StagingBuffer
from tests.helpers.model_runner import PROMPTS, driver_for, make_runner

MAX_TOKENS = 6


def _greedy_outputs(tiny_llama: Any, model_refs: Any, stage_on_host: bool) -> dict[str, list[int]]:
    class Staged(StagingBuffer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["stage_on_host"] = stage_on_host
            super().__init__(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner_module, "StagingBuffer", Staged)
        runner = make_runner(tiny_llama, model_refs)
        # A budget that splits the longest prompt: chunks that sample nothing, then decodes.
        driver = driver_for(runner, budget=24)
        for name, prompt in PROMPTS.items():
            driver.add(name, prompt, max_tokens=MAX_TOKENS)
        outputs: dict[str, list[int]] = driver.run()
        assert all(not buf.direct for buf in runner._staging.values()) is stage_on_host
    return outputs


def _hf_greedy(path: Any, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,  # random weights may pick EOS early
        )
    return list(out[0, len(prompt) :].tolist())


def test_the_cpu_step_reads_its_arrays_as_the_staged_path_copies_them(tiny_llama, model_refs):
    direct = _greedy_outputs(tiny_llama, model_refs, stage_on_host=False)
    assert direct == _greedy_outputs(tiny_llama, model_refs, stage_on_host=True)
    assert direct == {name: _hf_greedy(tiny_llama, p) for name, p in PROMPTS.items()}
