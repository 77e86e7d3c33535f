"""What the checkpoint and the config set for every request: the sampling defaults of
``generation_config.json`` (as vLLM applies them) and the chat template."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError

#: generation_config.json key -> SamplingParams field (vLLM reads the same ones).
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The checkpoint's recommended sampling values (empty with ``generation_config =
    "vllm"`` or without the file)."""
    if config.model.generation_config != "auto" or not config.model.path:
        return {}
    path = pathlib.Path(config.model.path)
    gen_config = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not gen_config.is_file():
        return {}
    try:
        data = json.loads(gen_config.read_text())
    except ValueError as exc:
        raise ConfigError(f"{gen_config} is not valid JSON: {exc}") from None
    return {
        field: data[key]
        for key, field in GENERATION_CONFIG_KEYS.items()
        if isinstance(data.get(key), int | float) and not isinstance(data.get(key), bool)
    }


def configured_chat_template(config: EngineConfig) -> str | None:
    """``model.chat_template``: a file's text, or the template itself."""
    value = config.model.chat_template
    if value is None:
        return None
    if "{" in value:  # Jinja text: every template has a {{ or {%
        return value
    path = pathlib.Path(value)
    if not path.is_file():
        raise ConfigError(
            f"chat_template {value!r} is neither a file nor a template (Jinja text with "
            "{{ ... }} or {% ... %})"
        )
    return path.read_text()
