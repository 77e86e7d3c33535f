"""Attention backends and linear methods from plugins: registered, selected, used.

- A third-party attention backend, pip-installed as a real package
  (``tests/plugins/enginecore-naive-attention``), passes the contract with its own tests
  and, selected from a config file, serves greedy tokens equal to transformers'.
- A linear method registered through ``register_linear_methods`` is selected by name,
  computes every projection of the model, and the logits stay transformers'.
- ``auto`` picks ``cpu`` and ``cpu_packed`` on CPU; a named backend that cannot run the
  model is refused at start-up, saying why and which can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import enginecore
from enginecore import make_config
from enginecore.engine.components import resolve_components
from enginecore.errors import ConfigError
from enginecore.layers import UnquantizedLinearMethod
from enginecore.plugins import make_plugin_manager
from enginecore_models.model_runner import TorchModelRunner
from tests.helpers.hf_reference import greedy_reference
from tests.helpers.plugin_install import install_to_target, with_on_path

NAIVE_PLUGIN = Path(__file__).parents[1] / "plugins" / "enginecore-naive-attention"


@pytest.fixture(scope="module")
def naive_env(tmp_path_factory) -> dict[str, str]:
    """The plugin pip-installed into a private target dir (on PYTHONPATH of children
    only: this process's plugin managers must not see it)."""
    target = install_to_target(NAIVE_PLUGIN, tmp_path_factory.mktemp("naive-plugin"))
    env = dict(os.environ)
    with_on_path(env, target)
    return env


def test_the_plugin_passes_the_contract_with_its_own_tests(naive_env):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(NAIVE_PLUGIN / "tests"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=naive_env,
        cwd=NAIVE_PLUGIN,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


SERVE_NAIVE = """
import json, sys
from enginecore import LLM, SamplingParams

prompts = json.loads(sys.argv[2])
with LLM(config_file=sys.argv[1]) as llm:
    [backend] = llm.collective_rpc(lambda w: type(w.model_runner.attn_backend).__name__)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    print(json.dumps({"backend": backend, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


@pytest.mark.slow  # over 10 s; `make test-all` runs it
def test_hook_register_attention_backends(naive_env, tiny_llama, tmp_path):
    """The installed backend, named in a config file, serves transformers' greedy tokens
    in one mixed batch with chunked prefill and a prefix-cache hit."""
    config = tmp_path / "engine.toml"
    config.write_text(
        f'[model]\npath = "{tiny_llama}"\nattention_backend = "naive"\ndtype = "float32"\n'
        "[scheduler]\nmax_num_batched_tokens = 32\n"
    )
    shared = list(range(40, 72))
    prompts = [[*shared, 5, 6, 7], list(range(100, 110)), [*shared, 9], [300, 301]]
    done = subprocess.run(
        [sys.executable, "-c", SERVE_NAIVE, str(config), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
        env=naive_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "NaiveAttentionBackend"
    for prompt, tokens in zip(prompts, result["tokens"], strict=True):
        assert tokens == greedy_reference(tiny_llama, prompt, 8, torch.float32)[0]


class CountingLinearMethod(UnquantizedLinearMethod):
    """The reference method, counting the projections it computes."""

    name = "counting"
    calls = 0

    def apply(self, layer, x, bias=None):
        type(self).calls += 1
        return F.linear(x, layer.weight, bias)


def _registering(hook_name: str, name: str, factory):
    def impl(registry):
        registry.add(name, factory)

    impl.__name__ = hook_name
    return type("Plugin", (), {hook_name: staticmethod(enginecore.hookimpl(impl))})()


def test_hook_register_linear_methods(tiny_llama):
    from transformers import AutoModelForCausalLM

    from enginecore.testing.attention_steps import make_batch, step_context

    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(
        _registering("register_linear_methods", "counting", CountingLinearMethod), "counting"
    )
    config = make_config(model=str(tiny_llama), linear_method="counting", dtype="float32")
    components = resolve_components(config, host)
    assert components.providers["linear_method"] == "counting (from counting)"
    runner = TorchModelRunner(config, components.worker_spec)
    runner.load_model()
    projections = [m for m in runner.model.modules() if hasattr(m, "linear_method")]
    assert projections and all(type(m.linear_method) is CountingLinearMethod for m in projections)
    ids = torch.tensor([3, 17, 256, 1024, 77, 5])
    runner.initialize_kv_cache(4)
    ctx = step_context(runner.attn_backend, make_batch([len(ids)], [0], [[2, 0]], 16))
    CountingLinearMethod.calls = 0
    with torch.inference_mode():
        got = runner.model.compute_logits(runner.model(ids, torch.arange(6), runner.kv_caches, ctx))
    assert CountingLinearMethod.calls == 4 * 4 + 1  # qkv, o, gate_up, down per layer + head
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_auto_picks_the_cpu_backend_and_packed_projections_on_cpu(tiny_llama):
    runner = TorchModelRunner(
        make_config(model=str(tiny_llama)),
        resolve_components(make_config(model=str(tiny_llama)), make_plugin_manager()).worker_spec,
    )
    runner.load_model()
    assert runner.attn_backend.name == "cpu"
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.linear_method.name == "cpu_packed"


def test_a_named_backend_that_cannot_run_the_model_is_refused(tiny_llama):
    config = make_config(model=str(tiny_llama), attention_backend="flash_attn")
    runner = TorchModelRunner(config, resolve_components(config, make_plugin_manager()).worker_spec)
    with pytest.raises(
        ConfigError, match=r"attention_backend 'flash_attn' cannot run this model.*torch"
    ):
        runner.load_model()


def test_an_unknown_backend_name_fails_before_anything_loads():
    from enginecore.errors import UnknownComponentError

    config = make_config(model="unused", attention_backend="no_such_backend")
    with pytest.raises(UnknownComponentError, match="no_such_backend"):
        resolve_components(config, make_plugin_manager())
