"""Our GGUF loader (gguf package, de-quantized, rope permutation undone) vs transformers'."""

from __future__ import annotations

import pytest
import torch

from enginecore_models.gguf_archs import unpermute_rope as _unpermute_rope


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (interleave each head's halves)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(3 * 64, 40)
    assert torch.equal(_unpermute_rope(_llama_cpp_permute(w, 3), 3), w)
    assert not torch.equal(_llama_cpp_permute(w, 3), w)


@pytest.mark.slow
def test_demo_gguf_logits_equal_transformers(model_refs):
    from transformers import AutoModelForCausalLM

    from enginecore.checkpoints import find_demo_gguf
    from enginecore.engine.tokenizer import gguf_tokenizer
    from enginecore.layers.torch_attention import TorchAttentionBackend
    from enginecore.testing.attention_steps import make_batch, spec_for_model, step_context
    from enginecore_models.weight_loader import (
        iter_weights,
        load_hf_config,
        resolve_model_class,
    )

    path = find_demo_gguf()
    cfg = load_hf_config(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    model = resolve_model_class(cfg, model_refs)(cfg)
    model.load_weights(iter_weights(path, cfg))
    tok = gguf_tokenizer(path)
    ids = torch.tensor(tok("The capital of France is")["input_ids"])

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    bs = 4
    pos = torch.arange(len(ids))
    backend = TorchAttentionBackend(spec_for_model(model, block_size=bs))
    kv = backend.allocate_kv_cache(6)
    ctx = step_context(backend, make_batch([len(ids)], [0], [[5, 1, 3]], bs))
    with torch.no_grad():
        got = model.compute_logits(model(ids, pos, kv, ctx))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert tok.decode(got[-1].argmax()) == " Paris"
