"""The LoRA adapters a server offers as models: ``--lora-modules`` and run-time loads.

Each adapter is a model name (``model: "name"`` in a request selects it) listed in
``/v1/models`` with the base model as its ``parent``. With run-time updating allowed
(``allow_runtime_lora_updating``, or ``ENGINECORE_ALLOW_RUNTIME_LORA_UPDATING=1`` as
vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` change the list without a restart. An adapter is checked
when it is added (config, rank, targets). The ``--lora-modules`` adapters are read by
the workers while the engine starts (``enginecore.lora.modules``, which also gives their
ids); a run-time load answers once the engine has read them (or with the reason it could
not), while other requests keep running. An unload frees the workers' copies once the
requests already sent with the adapter have finished; a request naming it afterwards is
a 404.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from enginecore.config import EngineConfig
from enginecore.engine.mp_client import UtilityError
from enginecore.errors import ConfigError
from enginecore.lora.adapter import check_adapter
from enginecore.lora.modules import lora_module_requests
from enginecore.lora_request import LoRAAdapterError, LoRARequest
from enginecore.server.context import context
from enginecore.server.errors import APIError

RUNTIME_UPDATING_ENV = "ENGINECORE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(config: EngineConfig) -> bool:
    env = os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower()
    return config.lora.allow_runtime_lora_updating or env in ("1", "true", "yes")


class LoRAModels:
    """Name -> :class:`LoRARequest`; ids are never reused, so an adapter loaded again
    under an old name is read afresh by the engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.base_name = config.model.served_model_name or config.model.path
        self.adapters: dict[str, LoRARequest] = {}
        if config.lora.lora_modules and not config.lora.enable_lora:
            raise ConfigError("lora_modules needs enable_lora (--enable-lora)")
        modules = lora_module_requests(config.lora)
        # Run-time loads take the ids after the start-up adapters' (the workers hold
        # those under 1..N).
        self._ids = itertools.count(len(modules) + 1)
        for lora in modules:
            try:
                self.add(lora.lora_name, lora.lora_path, lora.lora_int_id)
            except LoRAAdapterError as exc:
                raise ConfigError(f"lora_modules entry {lora.lora_name!r}: {exc}") from None

    def add(self, name: str, path: str, lora_int_id: int | None = None) -> LoRARequest:
        if name in self.adapters or name in (
            self.base_name,
            *self.config.model.served_model_aliases,
        ):
            raise LoRAAdapterError(f"a model named {name!r} is already served")
        check_adapter(path, self.config.lora.max_lora_rank)
        lora = LoRARequest(name, lora_int_id or next(self._ids), path)
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        return lora

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": lora.lora_name,
                "object": "model",
                "created": created,
                "owned_by": "enginecore",
                "root": lora.lora_path,
                "parent": self.base_name,
            }
            for lora in self.adapters.values()
        ]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    loras = context(request).loras
    if not loras.config.lora.enable_lora:
        raise APIError(400, "LoRA is off: start the server with --enable-lora")
    try:
        # Reads the adapter's config and safetensors header: off the event loop.
        lora = await asyncio.to_thread(loras.add, body.lora_name, body.lora_path)
    except LoRAAdapterError as exc:
        raise APIError(400, str(exc), param="lora_path") from None
    try:
        await context(request).engine.add_lora(lora)  # the engine reads the weights
    except UtilityError as exc:
        loras.adapters.pop(body.lora_name, None)
        message = str(exc).removeprefix(f"{LoRAAdapterError.__name__}: ")
        raise APIError(400, message, param="lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(
    body: UnloadLoRAAdapterRequest, request: Request
) -> PlainTextResponse:
    lora = context(request).loras.remove(body.lora_name)  # new requests naming it: 404
    # Every worker frees its copies once the requests sent with it have finished.
    await context(request).engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
