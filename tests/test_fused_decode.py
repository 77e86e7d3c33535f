"""The CPU backend's fused decode step (``builtin_cpu/decode_step.py``): a whole decode
step of a Llama-family model with block-quantized weights in one foreign call, whose
tokens and log-probabilities are the layer-by-layer path's bit for bit."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from enginecore.builtin_cpu import cpu_kernels, quant_kernels
from tests.gguf_writer import write_gguf

needs_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None or quant_kernels.load() is None, reason="no C compiler"
)
pytestmark = needs_kernels

# Prompts of different lengths, so steps hold one to four decoding rows, and mixed steps
# (a prompt's chunk beside decodes) take the layers in between.
PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 41, 12))]


def _generate(path: pathlib.Path, fused: bool, monkeypatch, **engine: Any) -> tuple[list, Any]:
    """Each request's tokens and log-probabilities, and how many steps ran fused."""
    from enginecore import LLM, SamplingParams

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(str(path), multiprocessing=False, max_num_batched_tokens=32, **engine)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        steps = llm.collective_rpc(
            lambda worker: getattr(worker.model_runner.fused_decode, "steps", None)
        )[0]
    finally:
        llm.shutdown()
    answers = [
        (
            o.outputs[0].token_ids,
            [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]
    return answers, steps


def _same_as_layers(path: pathlib.Path, monkeypatch, **engine: Any) -> None:
    fused, steps = _generate(path, True, monkeypatch, **engine)
    layered, off = _generate(path, False, monkeypatch, **engine)
    assert off is None  # switched off: no fused step was made
    assert steps and steps >= 20, steps  # most of the 24 decode steps ran fused
    assert fused == layered


def _mixed_4_and_8_bits(name: str) -> str:
    return "Q8_0" if "ffn_down" in name or "attn_v" in name else "Q4_1"


def _q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: V and the down projection in Q6_K, the rest in Q4_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"


def test_q4_1_and_q8_0_blocks_decode_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    path = write_gguf(tiny_llama, tmp_path / "mixed.gguf", types=_mixed_4_and_8_bits)
    _same_as_layers(path, monkeypatch)


def test_k_quants_decode_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    """Q4_K beside Q6_K in one fused QKV: the 6-bit part takes the sub-block kernel."""
    path = write_gguf(tiny_llama, tmp_path / "q4_k_m.gguf", types=_q4_k_m)
    _same_as_layers(path, monkeypatch)


def _q5_k_m(name: str) -> str:
    """llama.cpp's Q5_K_M mix: V and the down projection in Q6_K, the rest in Q5_K."""
    return "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q5_K"


def test_q5_k_beside_q6_k_decodes_fused_as_layer_by_layer(tiny_llama, tmp_path, monkeypatch):
    """Q and K in Q5_K, V in Q6_K in one fused QKV: two parts of the packed sub-block
    kernel, one for each bit width."""
    path = write_gguf(tiny_llama, tmp_path / "q5_k_m.gguf", types=_q5_k_m)
    _same_as_layers(path, monkeypatch)


def test_qwen2_qkv_bias_decodes_fused_as_layer_by_layer(tiny_qwen2, tmp_path, monkeypatch):
    """Random (not zero) Q/K/V biases: the fused step adds them as the layers do."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    biased = tmp_path / "biased"
    shutil.copytree(tiny_qwen2, biased)
    tensors = load_file(biased / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in tensors.items():
        if name.endswith("_proj.bias"):
            tensors[name] = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
    save_file(tensors, biased / "model.safetensors")
    path = write_gguf(biased, tmp_path / "qwen2.gguf", types=lambda name: "Q4_0")
    _same_as_layers(path, monkeypatch)


def test_int8_sliding_window_decodes_fused_as_layer_by_layer(checkpoint_factory, monkeypatch):
    """A float checkpoint quantized to int8 at load, with a window shorter than the
    prompts: the fused step attends over the window as the layers do."""
    path = checkpoint_factory("mistral", sliding_window=16)
    _same_as_layers(path, monkeypatch, quantization="int8")


def test_float_weights_run_layer_by_layer(tiny_llama, monkeypatch):
    """Without blocks (float32 weights, ``cpu_packed``) there is no fused step."""
    _, steps = _generate(tiny_llama, True, monkeypatch)
    assert steps is None
