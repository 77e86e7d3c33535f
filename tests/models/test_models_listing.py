"""``enginecore models`` lists the registered architectures with their plugin and
features, and docs/models.md is that listing."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from enginecore.model_listing import model_rows, render_markdown
from enginecore.plugins import make_plugin_manager

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


def _cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "enginecore.cli", "models", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def test_models_json_lists_architectures_plugins_and_features():
    rows = {r["architecture"]: r for r in json.loads(_cli("--json"))}
    for arch in (
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "MixtralForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "Olmo2ForCausalLM",
    ):
        assert rows[arch]["plugin"] == "builtin_models", arch
    assert rows["MixtralForCausalLM"]["features"] == ["sliding_window", "moe", "tp", "pp"]
    assert "moe" not in rows["LlamaForCausalLM"]["features"]
    assert "gguf" in rows["LlamaForCausalLM"]["features"]
    assert rows["GPT2LMHeadModel"]["features"] == ["tp"]


def test_models_text_names_each_architecture_with_its_features():
    text = _cli()
    line = next(x for x in text.splitlines() if x.startswith("Qwen3MoeForCausalLM"))
    assert "[builtin_models]" in line and "MoE" in line and "sliding window" in line


def test_docs_models_md_matches_the_registry():
    want = render_markdown(model_rows(make_plugin_manager(load_entrypoints=False)))
    assert DOC.read_text() == want, "regenerate: enginecore models --markdown > docs/models.md"
