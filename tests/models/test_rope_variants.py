"""RoPE scaling variants and partial rotary give transformers' logits and tables."""

from __future__ import annotations

import pytest
import torch

from enginecore.checkpoints import make_random_checkpoint
from enginecore.layers.rotary import RotaryEmbedding, rope_parameters
from tests.helpers.model_logits import ATOL, load_ours, new_cache, reference_logits, run_chunks

THETA = 10000.0
HALF = 32  # half the tiny Llama's head dim (64)
# float32 angles of ~1000 radians carry ~1e-4 of rounding, whoever computes them.
TABLE_ATOL = 2e-4

VARIANTS = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0}),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "yarn": (
        "llama",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ),
    "yarn-mscale": (
        "llama",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
        },
    ),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_with_rope_scaling_matches_transformers(tmp_path, model_refs, variant):
    arch, params = VARIANTS[variant]
    rope = {**params, "rope_theta": THETA}
    path = make_random_checkpoint(
        tmp_path / variant, arch=arch, config_overrides={"rope_parameters": rope}
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 12, 4)
    got = run_chunks(model, ids, [(0, 11), (11, 12), (12, 29)], 4, list(range(8)), kv)
    torch.testing.assert_close(got, reference_logits(path, ids), atol=ATOL, rtol=0)


def test_partial_rotary_matches_transformers(tmp_path, model_refs):
    """Phi-3 with half of each head rotating (and LongRoPE on that half)."""
    quarter = 8  # the tiny Phi-3's head dim is 32: 16 rotating dims, 8 frequencies
    rope = {
        "rope_type": "longrope",
        "rope_theta": THETA,
        "short_factor": [1.0 + i / quarter for i in range(quarter)],
        "long_factor": [2.0 + i / quarter for i in range(quarter)],
        "original_max_position_embeddings": 512,
        "partial_rotary_factor": 0.5,
    }
    path = make_random_checkpoint(
        tmp_path / "phi3-partial",
        arch="phi3",
        config_overrides={"rope_parameters": rope, "partial_rotary_factor": 0.5},
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    model = load_ours(path, model_refs)
    assert model.model.rotary.rot_dim == 16
    kv = new_cache(model, 12, 4)
    got = run_chunks(model, ids, [(0, 11), (11, 12), (12, 29)], 4, list(range(8)), kv)
    torch.testing.assert_close(got, reference_logits(path, ids), atol=ATOL, rtol=0)


def _reference_table(hf_rotary, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin at one position, computed for a sequence ending there."""
    x = torch.zeros(1, 1, 1)
    cos, sin = hf_rotary(x, torch.tensor([[position]]))
    return cos[0, 0], sin[0, 0]


@pytest.mark.parametrize("position", [100, 511, 512, 700, 1500])
def test_longrope_switches_to_the_long_factors_past_the_original_length(position):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope = {
        "rope_type": "longrope",
        "rope_theta": THETA,
        "short_factor": [1.0 + i / HALF for i in range(HALF)],
        "long_factor": [3.0 + i / HALF for i in range(HALF)],
    }
    cfg = Phi3Config(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=2048,
        original_max_position_embeddings=512,
        rope_parameters=rope,
    )
    ours = RotaryEmbedding(64, 2048, rope_parameters(cfg))
    cos, sin = _reference_table(Phi3RotaryEmbedding(cfg), position)
    torch.testing.assert_close(ours.cos[position], cos, atol=TABLE_ATOL, rtol=0)
    torch.testing.assert_close(ours.sin[position, HALF:], sin[HALF:], atol=TABLE_ATOL, rtol=0)


@pytest.mark.parametrize("position", [10, 255, 256, 400, 1000])
def test_dynamic_ntk_grows_the_base_past_the_original_length(position):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": THETA},
    )
    ours = RotaryEmbedding(64, 1024, rope_parameters(cfg))
    cos, sin = _reference_table(LlamaRotaryEmbedding(cfg), position)
    torch.testing.assert_close(ours.cos[position], cos, atol=TABLE_ATOL, rtol=0)
    torch.testing.assert_close(ours.sin[position, HALF:], sin[HALF:], atol=TABLE_ATOL, rtol=0)
