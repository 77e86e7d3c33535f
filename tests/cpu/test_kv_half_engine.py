"""A float16 or bfloat16 KV cache (``cache.kv_cache_dtype``) under the engine on CPU: the
``cpu`` backend keeps the paged cache and the decode mirror in it; the fused decode step
decodes greedily as the layers over the same cache do, and as the ``torch`` backend with
the same half cache (SDPA over the rounded K/V); prefix-cache hits and preemption give
the tokens of a run without either."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from enginecore_cpu import cpu_kernels, decode_step, quant_kernels
from tests.helpers.gguf_writer import write_gguf

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or quant_kernels.load() is None, reason="no C compiler"
)
if cpu_kernels.load() is not None:
    decode_step.build()  # the step from the first decode (see test_fused_decode.py)

# Prompts of different lengths: steps of one to four decoding rows, and mixed steps.
PROMPTS = [list(range(3 + i, 3 + i + length)) for i, length in enumerate((5, 23, 41, 12))]


def _greedy(
    path: pathlib.Path, monkeypatch, *, fused: bool, prompts=PROMPTS, **engine: Any
) -> tuple[list[list[int]], Any, list[str]]:
    """Each request's greedy tokens, the fused steps run, and the KV cache's dtypes."""
    from enginecore import LLM, SamplingParams

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1" if fused else "0")
    engine = {"max_num_batched_tokens": 32, **engine}
    with LLM(str(path), multiprocessing=False, **engine) as llm:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps, dtypes = llm.collective_rpc(
            lambda w: (
                getattr(w.model_runner.fused_decode, "steps", None),
                sorted({str(c.dtype) for c in w.model_runner.kv_caches}),
            )
        )[0]
    return [list(o.outputs[0].token_ids) for o in outs], steps, dtypes


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_the_fused_step_decodes_a_half_cache_as_the_layers(tiny_llama, tmp_path, monkeypatch, kv):
    """A Q4_0 file (the fused step's common case), GQA (2 query heads per KV head): the
    same tokens as the layers' kernels over the same cache."""
    path = write_gguf(tiny_llama, tmp_path / "q4_0.gguf", types=lambda name: "Q4_0")
    fused, steps, dtypes = _greedy(path, monkeypatch, fused=True, kv_cache_dtype=kv)
    assert dtypes == [f"torch.{kv}"] and steps and steps >= 10, (dtypes, steps)
    layered, off, _ = _greedy(path, monkeypatch, fused=False, kv_cache_dtype=kv)
    assert off is None and fused == layered


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_the_fused_step_decodes_a_half_cache_greedy_as_the_torch_backend(
    tiny_llama, monkeypatch, kv
):
    """Float32 weights (a Q4_0 file's 8-bit activations would turn the backends' float
    rounding into different tokens of a random model): the tokens of SDPA over the
    ``torch`` backend's paged cache in the same dtype."""
    fused, steps, _ = _greedy(tiny_llama, monkeypatch, fused=True, kv_cache_dtype=kv)
    assert steps and steps >= 10, steps
    torch_backend, _, dtypes = _greedy(
        tiny_llama, monkeypatch, fused=False, kv_cache_dtype=kv, attention_backend="torch"
    )
    assert dtypes == [f"torch.{kv}"] and fused == torch_backend


def test_a_half_cache_with_a_sliding_window_decodes_fused_as_the_torch_backend(
    checkpoint_factory, monkeypatch
):
    """A window shorter than the prompts (float32 weights)."""
    path = checkpoint_factory("mistral", sliding_window=16)
    engine = {"kv_cache_dtype": "float16"}
    fused, steps, _ = _greedy(path, monkeypatch, fused=True, **engine)
    assert steps and steps >= 10, steps
    torch_backend, _, _ = _greedy(
        path, monkeypatch, fused=False, attention_backend="torch", **engine
    )
    assert fused == torch_backend


def test_many_rows_of_a_half_cache_decode_fused_as_the_torch_backend(tiny_llama, monkeypatch):
    """Forty requests decoding together over float32 weights."""
    prompts = [[(i * 37 + j) % 200 + 3 for j in range(4 + i % 9)] for i in range(40)]
    engine = {"kv_cache_dtype": "bfloat16", "max_num_batched_tokens": 512}
    fused, steps, _ = _greedy(tiny_llama, monkeypatch, fused=True, prompts=prompts, **engine)
    assert steps and steps >= 10, steps
    torch_backend, _, _ = _greedy(
        tiny_llama, monkeypatch, fused=False, prompts=prompts, attention_backend="torch", **engine
    )
    assert fused == torch_backend


def test_a_preempted_prefix_cached_batch_over_a_half_cache_decodes_as_without_either(
    tiny_llama, monkeypatch
):
    """Sixteen requests through a cache too small for them (preemption drops mirror rows
    and recomputes K/V), shared prefixes (hits read the rounded K/V an earlier request
    wrote), chunked prompts beside decodes: the greedy tokens of a roomy cache without
    prefix caching. Every read of K/V sees it as the cache holds it, prompts included."""
    from enginecore import LLM, SamplingParams
    from tests.helpers.prompts import mixed_prompts

    monkeypatch.setenv("ENGINECORE_FUSED_DECODE", "1")
    prompts = mixed_prompts(4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    common = {"kv_cache_dtype": "float16", "multiprocessing": False}
    common.update(max_num_batched_tokens=32, block_size=16)
    runs = []
    for tight in (True, False):
        engine = {"prefix_caching": tight, "num_blocks_override": 24 if tight else 512}
        with LLM(tiny_llama, **common, **engine) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        if tight:
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "no preemption forced"
            assert any(o.num_cached_tokens > 0 for o in outs), "no prefix-cache hit"
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_a_half_cache_holds_twice_the_blocks_in_the_same_bytes(tiny_llama):
    from enginecore import LLM

    blocks = {}
    for kv in ("auto", "float16"):
        with LLM(
            str(tiny_llama), multiprocessing=False, kv_cache_bytes=8 << 20, kv_cache_dtype=kv
        ) as llm:
            blocks[kv] = llm.collective_rpc(lambda w: w.model_runner.kv_caches[0].shape[1])[0]
    assert blocks["float16"] == 2 * blocks["auto"], blocks
