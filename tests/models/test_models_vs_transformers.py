"""Our models over paged attention give transformers' logits, for every architecture."""

from __future__ import annotations

import pathlib

import pytest
import torch

from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context
from enginecore_models.weight_loader import (
    MissingWeightsError,
    UnknownArchitectureError,
    iter_weights,
    load_hf_config,
    resolve_model_class,
)

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]
ATOL = 2e-5


def load_ours(path: pathlib.Path, model_refs: dict[str, str]) -> torch.nn.Module:
    cfg = load_hf_config(path)
    model = resolve_model_class(cfg, model_refs)(cfg)
    model.load_weights(iter_weights(path, cfg))
    return model.eval()


def reference_logits(path: pathlib.Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids[None]).logits[0]


def new_cache(model: torch.nn.Module, num_blocks: int, block_size: int) -> tuple:
    """The reference backend for ``model`` and a KV cache of ``num_blocks`` blocks."""
    backend = TorchAttentionBackend(spec_for_model(model, block_size=block_size))
    return backend, backend.allocate_kv_cache(num_blocks)


def run_chunks(
    model: torch.nn.Module,
    ids: torch.Tensor,
    chunks: list[tuple[int, int]],
    block_size: int,
    blocks: list[int],
    kv: tuple,
) -> torch.Tensor:
    """Feed one request's tokens chunk by chunk through the paged cache; all logits."""
    backend, caches = kv
    out = []
    for a, b in chunks:
        pos = torch.arange(a, b)
        ctx = step_context(backend, make_batch([b - a], [a], [blocks], block_size))
        with torch.no_grad():
            out.append(model.compute_logits(model(ids[a:b], pos, caches, ctx)))
    return torch.cat(out)


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


def run_mixed_batch(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Four requests through two forwards that mix decodes and prefill chunks: step 1
    prefills the first 4, 12, 8 and 6 tokens; step 2 decodes the first three (their last
    prompt token) and runs the fourth's remaining 14 tokens as a chunk. Returns the
    prompts and each one's logits, gathered across the steps."""
    torch.manual_seed(1)
    prompts = [torch.randint(3, 8000, (n,)) for n in (5, 13, 9, 20)]
    bs = 4
    kv = new_cache(model, 40, bs)
    tables = [[0, 1], [2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13]]
    steps = [[(0, 4), (0, 12), (0, 8), (0, 6)], [(4, 5), (12, 13), (8, 9), (6, 20)]]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in steps:
        order = sorted(range(len(prompts)), key=lambda i: step[i][1] - step[i][0] != 1)
        num_decodes = sum(1 for i in order if step[i][1] - step[i][0] == 1)
        ids = torch.cat([prompts[i][step[i][0] : step[i][1]] for i in order])
        pos = torch.cat([torch.arange(*step[i]) for i in order])
        rows = torch.cat([torch.full((step[i][1] - step[i][0],), i) for i in order])
        batch = make_batch(
            [step[i][1] - step[i][0] for i in order],
            [step[i][0] for i in order],
            [tables[i] for i in order],
            bs,
        )
        assert batch.num_decodes == num_decodes
        with torch.no_grad():
            logits = model.compute_logits(model(ids, pos, kv[1], step_context(kv[0], batch)))
        for i in order:
            got[i].append(logits[rows == i])
    return prompts, [torch.cat(g) for g in got]


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
