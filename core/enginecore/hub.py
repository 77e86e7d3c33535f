"""Hugging Face Hub ids as model names, as vLLM users type them
(``enginecore serve HuggingFaceTB/SmolLM2-135M-Instruct``): the local Hugging Face cache
first, then a download unless ``HF_HUB_OFFLINE`` is set. A path that exists is never
looked up, and a name that is neither says what was tried."""

from __future__ import annotations

import os
import pathlib
import re

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError

#: ``org/name`` as the Hub spells repository ids.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(config: EngineConfig) -> EngineConfig:
    """``config`` with a Hub id replaced by its local snapshot directory, served under the
    id (unless ``served_model_name`` says otherwise); anything else unchanged."""
    source = config.model.path
    if not source or pathlib.Path(source).exists() or not _REPO_ID.match(source):
        return config
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = snapshot_download(source, local_files_only=True)
    except LocalEntryNotFoundError:
        if _offline():
            raise ConfigError(
                f"model {source!r} is not a path, and the Hugging Face cache has no snapshot "
                "of it; HF_HUB_OFFLINE is set, so it is not downloaded (download it with "
                "`huggingface-cli download` where the Hub is reachable, or give a path)"
            ) from None
        try:
            local = snapshot_download(source)
        except Exception as exc:  # any network or Hub failure is said in one line
            raise ConfigError(
                f"model {source!r} is not a path, the Hugging Face cache has no snapshot of "
                f"it, and downloading it failed ({type(exc).__name__}: {exc}); give a "
                "checkpoint directory or .gguf file, or a Hub id that can be downloaded"
            ) from None
    return config.replace(model=local, served_model_name=config.model.served_model_name or source)
