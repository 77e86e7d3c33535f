"""Load the tokenizer of a checkpoint directory or a GGUF file, offline."""

from __future__ import annotations

import pathlib
from typing import Any

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError


def load_tokenizer(config: EngineConfig) -> Any:
    """A transformers tokenizer for the configured model (``model.tokenizer`` wins)."""
    source = config.model.tokenizer or config.model.path
    if not source:
        raise ConfigError("no model given: pass a checkpoint directory or .gguf file as 'model'")
    path = pathlib.Path(source)
    if not path.exists():
        raise ConfigError(f"model path {source!r} does not exist")
    from transformers import AutoTokenizer

    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ConfigError(
            f"could not load a tokenizer from {source!r}: {type(exc).__name__}: {exc}. "
            f"The directory needs tokenizer.json (or tokenizer files transformers can read); "
            f"set 'tokenizer' to load one from elsewhere."
        ) from exc
