"""Checks that run in the frontend before any process starts: a mistake in a name or a
path fails in a second with one line saying what would be valid, not after the engine
process has imported torch and reported it from there."""

from __future__ import annotations

import errno
import json
import logging
import pathlib
import socket

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError

logger = logging.getLogger("enginecore.startup")

#: uvicorn's default backlog.
LISTEN_BACKLOG = 2048


def check_model_path(config: EngineConfig) -> None:
    """The model is a checkpoint directory (with ``config.json``) or a ``.gguf`` file."""
    source = config.model.path
    if not source:
        raise ConfigError("no model given: pass a checkpoint directory or .gguf file as 'model'")
    path = pathlib.Path(source)
    if not path.exists():
        raise ConfigError(f"model path {source!r} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(
            f"model path {source!r} is a file but not a .gguf file: give a checkpoint "
            "directory (with config.json) or a .gguf file"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(
            f"model path {source!r} is not a checkpoint: it has no config.json (give a "
            "Hugging Face checkpoint directory or a .gguf file)"
        )


def _head_counts(checkpoint: pathlib.Path) -> tuple[int, int] | None:
    """``(attention heads, KV heads)`` from a checkpoint's config.json, when it says."""
    try:
        hf = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hf = hf.get("text_config", hf)  # multimodal checkpoints nest the language model's
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    if not isinstance(heads, int):
        return None
    kv_heads = hf.get("num_key_value_heads") or heads
    return heads, kv_heads


def check_parallel_layout(config: EngineConfig) -> None:
    """A ``tensor_parallel_size`` the model's heads cannot be split by fails here, in the
    frontend, naming the sizes that work, not inside every worker after the model loads."""
    tp = config.parallel.tensor_parallel_size
    path = pathlib.Path(config.model.path)
    counts = _head_counts(path) if tp > 1 and path.is_dir() else None
    if counts is None:
        return
    heads, kv_heads = counts
    kv_ok = kv_heads % tp == 0 or tp % kv_heads == 0  # split, or each KV head replicated
    if heads % tp == 0 and kv_ok:
        return
    working = [
        n
        for n in range(1, heads + 1)
        if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
    ]
    raise ConfigError(
        f"tensor_parallel_size {tp} cannot split this model: it has {heads} attention heads "
        f"and {kv_heads} KV heads; sizes that work: {', '.join(map(str, working))}"
    )


def warn_unused_memory_settings(config: EngineConfig, device: str) -> None:
    """A GPU memory setting given for a run on CPU is said, not silently ignored."""
    default = type(config.cache)().gpu_memory_utilization
    if device == "cpu" and config.cache.gpu_memory_utilization != default:
        logger.warning(
            "gpu_memory_utilization %s has no effect on CPU: the KV cache there takes "
            "--cpu-kv-cache-fraction of the free RAM (%s), or --kv-cache-bytes",
            config.cache.gpu_memory_utilization,
            config.cache.cpu_kv_cache_fraction,
        )


def reserve_port(host: str, port: int) -> socket.socket:
    """The HTTP port, bound and listening before the engine starts and held while it loads:
    a port checked and then let go could be taken by another process meanwhile (the server
    would fail only after loading the model, or a client would reach that other process).

    It listens at once because on Linux two sockets with ``SO_REUSEADDR`` may both bind a
    port while neither listens: a second server started during the first one's start-up
    would bind too, load its model, and never serve. Listening claims the port for good;
    connections made while the engine loads wait in the backlog and are answered once the
    server runs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is already in use: stop what listens there or "
                "pick another with --port"
            ) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
