"""Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, Gemma 1/2/3, Phi-3 and OLMo 2 against transformers.

Each architecture is made tiny from its transformers config class (hidden 128, 2
layers, 4 experts; Gemma's window of 8 tokens slides within these prompts; Phi-3 carries
LongRoPE) and must give transformers' logits through the paged cache chunk by chunk and
in a mixed batch, and its greedy tokens through ``LLM`` with chunked prefill and prefix
caching on.
"""

from __future__ import annotations

import pytest
import torch

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.model_logits import (
    ATOL,
    load_ours,
    new_cache,
    reference_logits,
    run_chunks,
    run_mixed_batch,
)
from tests.helpers.prompts import mixed_prompts

ARCHS = ["qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma", "gemma2", "gemma3", "phi3", "olmo2"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request, checkpoint_factory):
    return request.param, checkpoint_factory(request.param)


def test_chunked_prefill_then_decode_matches_transformers(arch_path, model_refs):
    _, path = arch_path
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 12, 4)
    chunks = [(0, 7), (7, 8), (8, 19), (19, 20), (20, 21), (21, 29)]
    got = run_chunks(model, ids, chunks, 4, [11, 2, 9, 0, 5, 7, 1, 3], kv)
    torch.testing.assert_close(got, reference_logits(path, ids), atol=ATOL, rtol=0)


def test_mixed_batch_matches_separate_references(arch_path, model_refs):
    """Decodes and prefill chunks of several requests in one forward (the experts of a
    MoE layer see every request's tokens at once)."""
    arch, path = arch_path
    prompts, got = run_mixed_batch(load_ours(path, model_refs))
    for prompt, logits in zip(prompts, got, strict=True):
        want = reference_logits(path, prompt)
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0, msg=arch)


# Through the whole engine: a MoE and an interleaved sliding/global model by default,
# every architecture in the slow suite.
FAST_ENGINE_ARCHS = {"mixtral", "gemma3"}


@pytest.mark.parametrize(
    "arch",
    [pytest.param(a, marks=() if a in FAST_ENGINE_ARCHS else pytest.mark.slow) for a in ARCHS],
)
def test_llm_greedy_matches_transformers_chunked_and_prefix_cached(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    prompts = mixed_prompts(3)[:7]
    max_tokens = 8
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        max_num_batched_tokens=32,  # long prompts are split across steps
        block_size=16,
        prefix_caching=True,  # every third prompt shares a 40-token prefix
        num_blocks_override=64,
    ) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # The first prompt alone caches the prefix the later batch's prompts 3 and 6 share.
        outputs = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        reference = greedy_reference(path, prompt, max_tokens)
        assert_matches_reference(out.outputs[0].token_ids, reference, arch)
    assert outputs[3].num_cached_tokens >= 32, "the shared prefix came from the cache"


def test_llama_with_gelu_activation_matches_transformers(tmp_path, model_refs):
    from enginecore.checkpoints import make_random_checkpoint

    path = make_random_checkpoint(
        tmp_path / "llama-gelu", config_overrides={"hidden_act": "gelu_pytorch_tanh"}
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (21,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 8, 4)
    got = run_chunks(model, ids, [(0, 9), (9, 10), (10, 21)], 4, list(range(6)), kv)
    torch.testing.assert_close(got, reference_logits(path, ids), atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "gemma2", "phi3"])
def test_enginecore_serve_gives_transformers_greedy_text(checkpoint_factory, tmp_path, arch):
    """Through the real server and the openai client, as a user would run it."""
    import openai
    from transformers import AutoTokenizer

    from tests.helpers.serve_process import serve, stop

    path = checkpoint_factory(arch)
    prompt = mixed_prompts(4)[3]
    proc, url = serve(path, tmp_path / "server.log", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
    finally:
        stop(proc)
    tokens, first_tie = greedy_reference(path, prompt, 8)
    assert first_tie == len(tokens), "a near tie: pick another prompt"
    assert reply.choices[0].text == AutoTokenizer.from_pretrained(path).decode(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_greedy_matches_transformers(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    prompts = mixed_prompts(3)[:4]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype="bfloat16", multiprocessing=False, max_num_batched_tokens=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        reference = greedy_reference(path, prompt, 10, torch.bfloat16)
        assert_matches_reference(out.outputs[0].token_ids, reference, f"{arch} prompt {i}")


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3_moe", {"mlp_only_layers": [0]}),  # a dense MLP on layer 0
        ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),  # MoE on layer 1
    ],
)
def test_moe_models_with_dense_layers_match_transformers(tmp_path, model_refs, arch, overrides):
    from enginecore.checkpoints import make_random_checkpoint
    from enginecore.layers.moe import FusedMoE

    path = make_random_checkpoint(tmp_path / arch, arch=arch, config_overrides=overrides)
    model = load_ours(path, model_refs)
    kinds = [
        isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in model.model.layers
    ]
    assert kinds == [False, True]
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (21,))
    kv = new_cache(model, 8, 4)
    got = run_chunks(model, ids, [(0, 9), (9, 10), (10, 21)], 4, list(range(6)), kv)
    torch.testing.assert_close(got, reference_logits(path, ids), atol=ATOL, rtol=0)
