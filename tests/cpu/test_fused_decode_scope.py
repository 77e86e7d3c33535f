"""The fused decode step stands in for a model's forward only where the model's own class
declares that forward to be its stack's: a plugin's model that subclasses a built-in and
overrides ``forward`` has its code run on every step, decode steps included."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
from typing import Any

import pytest

from enginecore_cpu import cpu_kernels, decode_step
from enginecore_models.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

MAX_TOKENS = 8


class CountingForCausalLM(LlamaForCausalLM):
    """A plugin's Llama whose forward does something of its own (here, counts)."""

    calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        type(self).calls += 1
        return super().forward(*args, **kwargs)


PLUGIN = f"""
import enginecore

@enginecore.hookimpl
def register_models(registry):
    registry.add("CountingForCausalLM", "{__name__}:CountingForCausalLM")
"""


def _install_plugin(site: pathlib.Path) -> None:
    """An installed distribution (a ``*.dist-info`` with its entry point) on ``sys.path``,
    which the engine's own plugin manager finds as it finds any installed plugin."""
    (site / "counting_llama_plugin.py").write_text(PLUGIN)
    info = site / "enginecore_counting_llama-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: enginecore-counting-llama\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text("[enginecore]\ncounting_llama = counting_llama_plugin\n")


def _serve(path: pathlib.Path) -> tuple[list[int], Any]:
    """The greedy tokens of one prompt, and how many steps ran fused (None: no step)."""
    from enginecore import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(path), multiprocessing=False) as llm:
        [out] = llm.generate([[5, 6, 7, 5, 6]], params, use_tqdm=False)
        steps = llm.collective_rpc(
            lambda worker: getattr(worker.model_runner.fused_decode, "steps", None)
        )[0]
    return list(out.outputs[0].token_ids), steps


def test_a_plugin_model_overriding_forward_runs_it_on_every_decode_step(
    tiny_llama, tmp_path, monkeypatch
):
    monkeypatch.setenv(decode_step.ENV_SWITCH, "1")
    decode_step.build()  # the step from the first decode, not after a background build
    # The built-in Llama's decode steps run fused here: the fast path is on.
    builtin, fused_steps = _serve(tiny_llama)
    assert fused_steps and fused_steps >= MAX_TOKENS - 2, fused_steps

    site = tmp_path / "site"
    site.mkdir()
    _install_plugin(site)
    monkeypatch.syspath_prepend(str(site))
    checkpoint = tmp_path / "counting"
    shutil.copytree(tiny_llama, checkpoint)
    hf_config = json.loads((checkpoint / "config.json").read_text())
    hf_config["architectures"] = ["CountingForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(hf_config))
    CountingForCausalLM.calls = 0
    try:
        tokens, steps = _serve(checkpoint)
    finally:
        sys.modules.pop("counting_llama_plugin", None)
    assert steps is None  # no fused step for a model whose forward is its own
    assert CountingForCausalLM.calls == MAX_TOKENS  # the prompt's step and every decode
    assert tokens == builtin
