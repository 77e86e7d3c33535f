"""``benchmarks/make_random_gguf.py``'s K-quant mixes: each tensor in the GGUF type the
format names, as llama.cpp's quantizer gives it for ``Q5_K_M``."""

from __future__ import annotations

import argparse

import pytest

from tests.helpers.script_module import load_script

gguf = pytest.importorskip("gguf")

LAYERS = 8


def _types(tmp_path, fmt: str) -> dict[str, str]:
    script = load_script("benchmarks/make_random_gguf.py")
    args = argparse.Namespace(
        out=tmp_path / f"{fmt}.gguf", format=fmt, hidden=256, layers=LAYERS, heads=4,
        kv_heads=2, intermediate=512, context=512, seed=0, vocab=512,
    )  # fmt: skip
    reader = gguf.GGUFReader(str(script.write(args)))
    return {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}


def test_q5_k_m_is_llama_cpps_mix(tmp_path):
    """Q6_K for the tied head (the token embedding) and for V and the down projection of
    the "more bits" layers (of 8: the first, the last, and every third from layer 1 on: 3
    and 6), Q5_K elsewhere."""
    types = _types(tmp_path, "Q5_K_M")
    assert types.pop("token_embd.weight") == "Q6_K"
    more_bits = {0, 3, 6, 7}
    for name, kind in types.items():
        layer, tensor = int(name.split(".")[1]), name.split(".")[2]
        six = tensor in ("attn_v", "ffn_down") and layer in more_bits
        assert kind == ("Q6_K" if six else "Q5_K"), name
    assert len(types) == 7 * LAYERS


def test_q4_k_m_keeps_v_and_down_in_q6_k(tmp_path):
    types = _types(tmp_path, "Q4_K_M")
    for name, kind in types.items():
        six = "attn_v" in name or "ffn_down" in name
        assert kind == ("Q6_K" if six else "Q4_K"), name
