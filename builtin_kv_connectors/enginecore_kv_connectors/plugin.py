"""Registers the built-in KV connectors: ``shared_storage`` and ``zmq_p2p``."""

from __future__ import annotations

from typing import Any

import enginecore

_PKG = "enginecore_kv_connectors"


@enginecore.hookimpl(trylast=True)
def register_kv_connectors(registry: Any) -> None:
    registry.add(
        "shared_storage",
        f"{_PKG}.shared_storage:SharedStorageConnector",
        summary="save/load prompt-prefix KV blocks in a shared directory (extra_config.path)",
    )
    registry.add(
        "zmq_p2p",
        f"{_PKG}.zmq_p2p:ZmqP2PConnector",
        summary="disaggregated prefill/decode: KV blocks sent over ZeroMQ",
    )
