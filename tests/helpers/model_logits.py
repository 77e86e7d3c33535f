"""Our model classes over paged attention against transformers' logits, chunk by chunk and in mixed batches."""

from __future__ import annotations

import pathlib

import torch

from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context
from enginecore_models.weight_loader import (
    iter_weights,
    load_hf_config,
    resolve_model_class,
)

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
