"""Exceptions users and plugin authors see. Each message says what went wrong and what to do."""

from __future__ import annotations


class EngineCoreError(Exception):
    """Base class of every enginecore error."""


class ConfigError(EngineCoreError, ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


class UnsupportedModelError(ConfigError):
    """The checkpoint needs something enginecore does not implement (an architecture
    option, a RoPE scaling type, a quantization method, a GGUF tensor type); the message
    names the model and the feature."""


class PluginError(EngineCoreError):
    """Base class of plugin loading and registration errors."""


class PluginLoadError(PluginError):
    """A plugin failed to import, validate or register."""


class DuplicateRegistrationError(PluginError):
    """Two plugins registered the same component name without ``override=True``."""

    plugin: str  # the plugin whose registration was refused


class UnknownComponentError(PluginError, ConfigError):
    """The config selects a component name that no loaded plugin registered."""


class IncompatiblePluginError(PluginLoadError):
    """A plugin declared a plugin-API range that excludes this enginecore."""


class InvalidRequestError(EngineCoreError, ValueError):
    """A request cannot be served as given (too long, bad sampling parameters, ...)."""


class EngineDeadError(EngineCoreError):
    """The engine (or one of its workers) died; every in-flight request fails with this."""


class RankError(EngineCoreError):
    """A collective_rpc call raised on one rank; the message names the rank. Executors raise
    it; the engine and its clients read ``rank`` and ``detail`` (across processes too)."""

    def __init__(self, rank: int, method: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        super().__init__(f"rank {rank} raised in {method}: {text}")
        self.rank = rank
        self.method = method
        self.original = exc
        self.detail = text  # what the rank raised, as text (crosses process boundaries)


class EngineShutdownError(EngineCoreError):
    """The engine was shut down before the request finished."""


#: How a request's error starts when its KV cache could not be loaded through the KV
#: connector (the server answers 502: the failure is upstream, not in the request).
KV_TRANSFER_ERROR_PREFIX = "KV connector "
