"""What a request names to be served with a LoRA adapter (vLLM's ``LoRARequest``)."""

from __future__ import annotations

import msgspec

from enginecore.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """An adapter by name, integer id and path (a PEFT directory with
    ``adapter_config.json`` and ``adapter_model.safetensors``).

    ``lora_int_id`` identifies the adapter's weights in the engine (>= 1; two requests
    with the same id share one loaded copy); ``lora_name`` is what the API calls it and
    what keys its prefix-cache blocks apart from other adapters'.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """Keys this adapter's prefix-cache blocks: its name and its weights' path."""
        return f"lora:{self.lora_name}:{self.lora_path}"


class LoRALoadReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model runner's adapter reads since its last step, by ``lora_int_id``: read and
    ready to run (``loaded``), refused or unreadable with the reason (``failed``), and
    dropped from host memory (``evicted``: a request naming it is read again)."""

    loaded: list[int] = []
    failed: dict[int, str] = {}
    evicted: list[int] = []


class LoRAAdapterError(InvalidRequestError):
    """The adapter cannot be served: missing files, a feature or rank this engine does not
    take. The message names the adapter and the setting. (Here, with the torch-free wire
    types, so that the scheduler can name a failed read without importing torch.)"""
