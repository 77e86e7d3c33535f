"""Load the tokenizer of a checkpoint directory or a GGUF file, offline."""

from __future__ import annotations

import hashlib
import importlib
import json
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
    try:
        if path.is_file() and path.suffix == ".gguf":
            return gguf_tokenizer(path)
        return checkpoint_tokenizer(path)
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
    stat = path.resolve().stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    saved = cache_dir() / "gguf-tokenizers" / hashlib.sha256(key).hexdigest()[:16]
    if (saved / "tokenizer_config.json").is_file():
        return checkpoint_tokenizer(saved)
    from transformers import AutoTokenizer

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


# Weights and other large files say nothing about the tokenizer and are not stat'ed.
_NOT_TOKENIZER_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def checkpoint_tokenizer(directory: pathlib.Path) -> Any:
    """``AutoTokenizer.from_pretrained(directory)``, without its cost after the first time.

    AutoTokenizer picks the tokenizer class by loading the model's config, which imports
    torch and transformers' model stack: about 3 s of a server's start on 2 cores, in the
    process that only tokenizes. The class it picked is recorded once per directory (the
    names, sizes and modification times of its files) under the cache directory; later
    loads call that class's ``from_pretrained``, which is what AutoTokenizer ends with.
    """
    record = _tokenizer_class_record(directory)
    try:
        module_name, class_name = json.loads(record.read_text())
        if module_name.startswith("transformers."):
            tokenizer_class = getattr(importlib.import_module(module_name), class_name)
            return tokenizer_class.from_pretrained(str(directory))
    except (OSError, ValueError, ImportError, AttributeError):
        pass  # no record yet, or one this transformers cannot follow
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    cls = type(tokenizer)
    _write_atomically(record, json.dumps([cls.__module__, cls.__qualname__]))
    return tokenizer


def _tokenizer_class_record(directory: pathlib.Path) -> pathlib.Path:
    import transformers

    resolved = directory.resolve()
    key = [str(resolved), transformers.__version__]
    for entry in sorted(resolved.iterdir()):
        if entry.is_file() and not entry.name.endswith(_NOT_TOKENIZER_FILES):
            stat = entry.stat()
            key.append(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}")
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    return cache_dir() / "tokenizer-classes" / f"{digest}.json"


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Write beside the place and rename: a concurrent start never reads half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".record-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the next start asks AutoTokenizer again
        pass
