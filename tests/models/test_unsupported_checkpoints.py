"""Checkpoints enginecore cannot run correctly are refused at load, naming the model and
the feature (never the executor that was loading them)."""

from __future__ import annotations

import json
import pathlib

import pytest

from enginecore import LLM
from enginecore.checkpoints import make_random_checkpoint
from enginecore.errors import EngineCoreError


def _with_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    """A copy of checkpoint ``src`` whose config.json has ``changes``."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _load_error(path: pathlib.Path, **kw) -> str:
    with pytest.raises(EngineCoreError) as err:
        LLM(str(path), dtype="float32", **kw)
    return str(err.value)


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"quant_method": "compressed-tensors", "format": "int-quantized"},
    ],
    ids=lambda q: q["quant_method"],
)
def test_quantized_checkpoint_is_refused_naming_the_method(tiny_llama, tmp_path, quantization):
    path = _with_config(tiny_llama, tmp_path / "quantized", quantization_config=quantization)
    message = _load_error(path, multiprocessing=False)
    assert repr(quantization["quant_method"]) in message
    assert "quantization_config" in message and "LlamaForCausalLM" in message
    assert "Supported: unquantized" in message
    assert "executor" not in message


def test_quantized_checkpoint_is_refused_with_the_engine_in_its_own_process(tiny_llama, tmp_path):
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    path = _with_config(tiny_llama, tmp_path / "fp8", quantization_config=quantization)
    message = _load_error(path)
    assert "'fp8'" in message and "executor" not in message


def test_unknown_rope_scaling_is_refused_naming_it(tiny_llama, tmp_path):
    rope = {"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    path = _with_config(tiny_llama, tmp_path / "mrope", rope_parameters=rope)
    message = _load_error(path, multiprocessing=False)
    assert "LlamaForCausalLM" in message and "'mrope'" in message
    assert "yarn" in message  # what is supported
    assert "executor" not in message


def test_unknown_activation_is_refused_naming_it(tiny_llama, tmp_path):
    path = _with_config(tiny_llama, tmp_path / "act", hidden_act="swiglu_oai")
    message = _load_error(path, multiprocessing=False)
    assert "LlamaForCausalLM" in message and "'swiglu_oai'" in message
    assert "executor" not in message


def test_not_implemented_in_a_model_class_names_the_model(tmp_path):
    """OLMo 2's whole-projection key norm cannot span replicated KV heads: refused with
    the architecture's name (the check runs while the model is built)."""
    from enginecore.distributed import ParallelContext
    from enginecore.errors import UnsupportedModelError
    from enginecore_models.models.olmo2 import Olmo2ForCausalLM
    from enginecore_models.weight_loader import load_hf_config

    path = make_random_checkpoint(tmp_path / "olmo2", arch="olmo2")
    cfg = load_hf_config(path)
    parallel = ParallelContext(world_size=4, tp_size=4)
    with pytest.raises(UnsupportedModelError, match="OLMo 2's key norm"):
        Olmo2ForCausalLM(cfg, parallel)


def test_float8_weights_without_a_quantization_config_are_refused(tiny_llama, tmp_path):
    """FP8 tensors copied into float parameters would load without their scales."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "fp8-tensors"
    dst.mkdir()
    for f in tiny_llama.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(str(tiny_llama / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(dst / "model.safetensors"))
    message = _load_error(dst, multiprocessing=False)
    assert name in message and "float8_e4m3fn" in message
    assert "executor" not in message
