"""What a grammar backend needs to know about the model: tokenizer, vocab size, EOS ids."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from enginecore.config import EngineConfig


def model_vocab_size(config: EngineConfig, tokenizer: Any) -> int:
    """The model's vocabulary (its logits' width), which may exceed the tokenizer's."""
    path = pathlib.Path(config.model.path)
    try:
        if path.is_dir():
            hf = json.loads((path / "config.json").read_text())
            size = hf.get("vocab_size") or (hf.get("text_config") or {}).get("vocab_size")
        else:
            from enginecore.block_formats.gguf_reader import GGUFMetadata

            size = GGUFMetadata(path).vocab_size()
    except (OSError, ValueError, AttributeError):
        size = None
    return int(size) if size else len(tokenizer)
