"""The LoRA adapters an ``LLM`` has served, by name, so that ``LLM.remove_lora`` takes a
name as the server's ``/v1/unload_lora_adapter`` does.

A removed name is refused in new requests (with the call that brings it back) until
``LLM.add_lora`` names it again, as the server answers 404 for an unloaded model.
"""

from __future__ import annotations

from collections.abc import Sequence

from enginecore.lora_request import LoRAAdapterError, LoRARequest


class LoRANames:
    def __init__(self) -> None:
        self._ids: dict[str, set[int]] = {}
        self._removed: set[str] = set()

    def use(self, loras: Sequence[LoRARequest | None]) -> None:
        """Note the adapters a call names; a removed one is refused before anything runs."""
        for lora in loras:
            if lora is None:
                continue
            if lora.lora_name in self._removed:
                raise LoRAAdapterError(
                    f"LoRA adapter {lora.lora_name!r} was removed (LLM.remove_lora); "
                    f"load it again with LLM.add_lora(LoRARequest(...)) before naming it"
                )
        for lora in loras:
            if lora is not None:
                self._ids.setdefault(lora.lora_name, set()).add(lora.lora_int_id)

    def added(self, lora: LoRARequest) -> None:
        self._removed.discard(lora.lora_name)
        self._ids.setdefault(lora.lora_name, set()).add(lora.lora_int_id)

    def remove(self, name: str) -> list[int]:
        """The engine ids served under ``name``; new requests naming it are refused."""
        ids = self._ids.pop(name, None)
        if ids is None:
            raise LoRAAdapterError(f"no LoRA adapter named {name!r} is loaded")
        self._removed.add(name)
        return sorted(ids)
