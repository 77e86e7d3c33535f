"""What every route needs: the engine and the resolved server settings (on ``app.state``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from enginecore.config import EngineConfig, ServerConfig


@dataclass
class ServerContext:
    config: EngineConfig
    engine: Any = None  # an AsyncLLM, set once it is running

    @property
    def limits(self) -> ServerConfig:
        return self.config.server

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name or self.config.model.path

    @property
    def model_path(self) -> str:
        return self.config.model.path

    @property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)


def context(request: Request) -> ServerContext:
    return request.app.state.ctx
