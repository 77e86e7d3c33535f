"""Our models over paged attention give transformers' logits, for every architecture."""

from __future__ import annotations

import pytest
import torch

from enginecore_models.weight_loader import (
    MissingWeightsError,
    UnknownArchitectureError,
    iter_weights,
    load_hf_config,
    resolve_model_class,
)
from tests.helpers.model_logits import (
    ATOL,
    load_ours,
    new_cache,
    reference_logits,
    run_chunks,
    run_mixed_batch,
)

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, checkpoint_factory, model_refs):
    path = checkpoint_factory(request.param)
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    return request.param, load_ours(path, model_refs), ids, reference_logits(path, ids)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_full_prefill_matches_transformers(arch_pair, block_size):
    _, model, ids, want = arch_pair
    nblocks = -(-len(ids) // block_size)
    # Scattered, non-contiguous blocks, so the block table really is followed.
    blocks = [(7 * i + 3) % (2 * nblocks + 1) for i in range(nblocks)]
    kv = new_cache(model, 2 * nblocks + 1, block_size)
    got = run_chunks(model, ids, [(0, len(ids))], block_size, blocks, kv)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_full_forward(arch_pair):
    _, model, ids, want = arch_pair
    block_size = 4
    blocks = [11, 2, 9, 0, 5, 7, 1, 3]
    kv = new_cache(model, 12, block_size)
    chunks = [(0, 7), (7, 8), (8, 19), (19, 20), (20, 21), (21, 29)]
    got = run_chunks(model, ids, chunks, block_size, blocks, kv)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_prefills(tiny_llama, model_refs):
    """Several requests in one forward (decodes and prefill chunks) equal separate runs."""
    prompts, got = run_mixed_batch(load_ours(tiny_llama, model_refs))
    for prompt, logits in zip(prompts, got, strict=True):
        want = reference_logits(tiny_llama, prompt)
        torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)


def test_missing_weights_are_named(tiny_llama, model_refs):
    cfg = load_hf_config(tiny_llama)
    model = resolve_model_class(cfg, model_refs)(cfg)
    weights = [(n, t) for n, t in iter_weights(tiny_llama, cfg) if "layers.1.mlp.up_proj" not in n]
    weights = [(n, t) for n, t in weights if n != "model.norm.weight"]
    with pytest.raises(MissingWeightsError) as err:
        model.load_weights(weights)
    assert "model.norm.weight" in str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)  # the checkpoint's name


def test_unknown_architecture_lists_registered(tiny_llama, model_refs):
    cfg = load_hf_config(tiny_llama)
    cfg.architectures = ["FancyNewForCausalLM"]
    with pytest.raises(UnknownArchitectureError) as err:
        resolve_model_class(cfg, model_refs)
    for name in ("FancyNewForCausalLM", "LlamaForCausalLM", "GPT2LMHeadModel"):
        assert name in str(err.value)
