"""Random test checkpoints load offline with transformers' Auto classes."""

from __future__ import annotations

import json

import pytest
import torch

ARCHS = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_random_checkpoint_loads_with_transformers(arch, checkpoint_factory, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = checkpoint_factory(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 8192
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 8192
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    ids = tok("def main():\n    return 42")["input_ids"]
    assert tok.decode(ids) == "def main():\n    return 42"  # byte-level BPE round-trips
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 8192)
    n_params = sum(p.numel() for p in model.parameters())
    assert 6e6 < n_params < 10e6  # tiny: ~8.1M (GPT-2 ~6.3M: tied head), as the peer harness


def test_same_seed_same_weights_other_seed_differs(checkpoint_factory, tmp_path):
    from safetensors.torch import load_file

    from enginecore.checkpoints import make_random_checkpoint

    a = load_file(checkpoint_factory("llama") / "model.safetensors")
    b = load_file(make_random_checkpoint(tmp_path / "again", "llama") / "model.safetensors")
    c = load_file(make_random_checkpoint(tmp_path / "other", "llama", seed=1) / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_small_size_config(tmp_path):
    from transformers import AutoConfig

    from enginecore.checkpoints import _make_hf_config, make_tokenizer

    cfg = _make_hf_config("qwen2", "small", make_tokenizer())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (768, 12, 12)
    assert (cfg.num_key_value_heads, cfg.intermediate_size) == (4, 2048)
    cfg.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "qwen2"


def test_unknown_arch_is_an_error(tmp_path):
    from enginecore.checkpoints import make_random_checkpoint

    with pytest.raises(ValueError, match="unknown arch"):
        make_random_checkpoint(tmp_path, arch="falcon")


@pytest.mark.slow
def test_demo_checkpoint_answers_paris(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from enginecore.checkpoints import make_demo_checkpoint

    path = make_demo_checkpoint(tmp_path / "demo")
    assert make_demo_checkpoint(tmp_path / "demo") == path  # idempotent, no rework
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=2)
    assert tok.decode(out[0, ids["input_ids"].shape[1] :]) == " Paris."
