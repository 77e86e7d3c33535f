"""What every route needs: the engine and the resolved server settings (on ``app.state``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from enginecore.config import EngineConfig, ServerConfig
from enginecore.engine.model_defaults import sampling_defaults
from enginecore.lora_request import LoRARequest
from enginecore.server.sampling import check_model

logger = logging.getLogger("enginecore.server")


@dataclass
class ServerContext:
    config: EngineConfig
    engine: Any = None  # an AsyncLLM, set once it is running
    loras: Any = None  # the LoRA adapters served as models (server.lora_models.LoRAModels)

    def resolve_model(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model; any other
        name is a 404."""
        if requested is not None and self.loras is not None:
            lora: LoRARequest | None = self.loras.adapters.get(requested)
            if lora is not None:
                return lora
        check_model(requested, self.model_name, self.model_path, self.model_aliases)
        return None

    def response_model(self, requested: str | None) -> str:
        """The ``model`` a response names: the adapter the request chose, or the base."""
        if requested is not None and self.loras is not None and requested in self.loras.adapters:
            return requested
        return self.model_name

    @property
    def limits(self) -> ServerConfig:
        return self.config.server

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name or self.config.model.path

    @property
    def model_aliases(self) -> list[str]:
        """The further served names (vLLM's ``--served-model-name a b``: ``b``)."""
        return list(self.config.model.served_model_aliases)

    @property
    def model_path(self) -> str:
        return self.config.model.path

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, Any]:
        """The checkpoint's generation_config.json values for fields a request leaves out."""
        defaults = sampling_defaults(self.config)
        if defaults:
            logger.info("sampling defaults from the checkpoint's generation_config: %s", defaults)
        return defaults

    @property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)


def context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx
