"""Load the tokenizer of a checkpoint directory or a GGUF file, offline."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile
from typing import Any

from enginecore.checkpoints import cache_dir
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
            return gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ConfigError(
            f"could not load a tokenizer from {source!r}: {type(exc).__name__}: {exc}. "
            f"The directory needs tokenizer.json (or tokenizer files transformers can read); "
            f"set 'tokenizer' to load one from elsewhere."
        ) from exc


def gguf_tokenizer(path: pathlib.Path) -> Any:
    """The tokenizer a GGUF file stores. transformers converts it from the file's token
    tables, which takes seconds (4.2 s for the demo model on 2 cores): the converted
    tokenizer is saved once per file (its path, size and modification time) under the
    cache directory and read back from there (0.4 s)."""
    from transformers import AutoTokenizer

    stat = path.resolve().stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    saved = cache_dir() / "gguf-tokenizers" / hashlib.sha256(key).hexdigest()[:16]
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    saved.parent.mkdir(parents=True, exist_ok=True)
    # Written beside its place and renamed: a concurrent start never reads half of it.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=saved.parent))
    try:
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, saved)
    except OSError:  # another process saved it first, or the cache is read-only
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
