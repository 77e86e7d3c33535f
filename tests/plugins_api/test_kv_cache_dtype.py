"""``cache.kv_cache_dtype``: each attention backend declares the KV cache dtypes it keeps
besides the model's (``AttentionCapabilities.kv_cache_dtypes``); one named that cannot
keep the chosen dtype is refused at start-up naming the setting and the backends that
can, and ``auto`` passes over it."""

from __future__ import annotations

import pytest
import torch

from enginecore import make_config
from enginecore.engine.components import resolve_components
from enginecore.errors import ConfigError
from enginecore.interfaces import AttentionSpec
from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.plugins import make_plugin_manager
from enginecore_attention.triton_backend import TritonAttentionBackend
from enginecore_cpu.attention import CpuAttentionBackend
from enginecore_models.model_runner import TorchModelRunner
from tests.helpers.gguf_writer import write_gguf


def _spec(dtype: torch.dtype, kv: torch.dtype | None, device: str = "cpu") -> AttentionSpec:
    return AttentionSpec(
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        device=torch.device(device),
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_dtype=kv,
    )


def test_backends_declare_the_kv_cache_dtypes_they_keep():
    half = _spec(torch.float32, torch.float16)
    assert CpuAttentionBackend.unsupported_reason(half) is None
    assert TorchAttentionBackend.unsupported_reason(half) is None
    reason = TritonAttentionBackend.unsupported_reason(_spec(torch.bfloat16, torch.float16, "cuda"))
    assert reason is not None and "kv_cache_dtype" in reason and "bfloat16" in reason
    # the model's own dtype, named: every backend keeps that
    assert "kv_cache_dtype" not in (
        TritonAttentionBackend.unsupported_reason(_spec(torch.bfloat16, None, "cuda")) or ""
    )
    assert "KV cache auto/float16/bfloat16" in CpuAttentionBackend.capabilities.describe()


def _load(tiny_llama, **settings) -> TorchModelRunner:
    config = make_config(model=str(tiny_llama), **settings)
    runner = TorchModelRunner(config, resolve_components(config, make_plugin_manager()).worker_spec)
    runner.load_model()
    return runner


def test_a_named_backend_that_cannot_keep_the_kv_cache_dtype_is_refused(tiny_llama):
    with pytest.raises(
        ConfigError,
        match=r"attention_backend 'triton' cannot run this model: keeps the KV cache in the "
        r"model's dtype \(float32\), not float16 \(kv_cache_dtype\) \(backends that can: cpu, "
        r"torch\)",
    ):
        _load(tiny_llama, attention_backend="triton", kv_cache_dtype="float16")


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_auto_picks_the_cpu_backend_and_sizes_blocks_in_the_dtype(tiny_llama, kv):
    runner = _load(tiny_llama, kv_cache_dtype=kv)
    backend = runner.attn_backend
    assert backend.name == "cpu" and backend.spec.cache_dtype == getattr(torch, kv)
    assert backend.spec.dtype == torch.float32  # the activations stay float32
    per_block = runner.get_kv_cache_block_bytes()
    assert per_block == 2 * 16 * 2 * 64 * 2 * backend.spec.num_layers  # two bytes a value


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, checkpoint_factory):
    return write_gguf(
        checkpoint_factory("llama"), tmp_path_factory.mktemp("gguf") / "q8.gguf", quantize=True
    )


def test_auto_keeps_a_gguf_files_kv_in_float16_on_cpu(llama_gguf, tiny_llama):
    """As llama.cpp keeps the K/V of these files; the activations stay float32, and
    ``float32`` named keeps the K/V unrounded."""
    spec = _load(llama_gguf).attn_backend.spec
    assert (spec.dtype, spec.cache_dtype) == (torch.float32, torch.float16)
    assert _load(llama_gguf, kv_cache_dtype="float32").attn_backend.spec.cache_dtype == (
        torch.float32
    )
    # a float checkpoint keeps its K/V in its dtype, token for token with transformers
    assert _load(tiny_llama).attn_backend.spec.cache_dtype == torch.float32


def test_auto_keeps_a_gguf_files_kv_in_the_models_dtype_under_a_backend_without_float16(
    llama_gguf, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton runs on CPU named, interpreted
    backend = _load(llama_gguf, attention_backend="triton").attn_backend
    assert backend.name == "triton" and backend.spec.cache_dtype == torch.float32
