"""Drives the worker half of a KV connector around one step of the torch model runner.

The runner calls :meth:`begin_step` before its forward pass and :meth:`end_step` after
it; attention calls :meth:`wait_for_layer_load` / :meth:`save_layer` per layer (through
``AttentionMetadata.kv_connector``). An exception from the connector never escapes into
the step: it fails the requests the step's metadata names (``load_request_ids`` /
``save_request_ids``, else every request of the step), and the engine frees their blocks.
Each such error names the connector, its plugin and the config key that selected it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from enginecore.component_kinds import KINDS
from enginecore.interfaces import KVConnectorWorker
from enginecore.plugin_attribution import attribute_origin
from enginecore.runner_output import KVConnectorOutput
from enginecore.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def layer_name(index: int) -> str:
    """The name a connector sees for the ``index``-th KV cache tensor of this rank."""
    return f"layer.{index}"


def describe_connector(connector: KVConnectorWorker, name: str) -> str:
    """``"KV connector 'x' from plugin 'p' (distribution d 1.0), config key
    kv_transfer.connector"``: what a worker-side connector error names."""
    origin = attribute_origin(type(connector))
    source = f" from {origin}" if origin else ""
    return f"KV connector {name!r}{source}, config key {KINDS['kv_connector'].config_key}"


class KVConnectorBridge:
    def __init__(
        self, connector: KVConnectorWorker, kv_caches: list[torch.Tensor], name: str = ""
    ) -> None:
        self.connector = connector
        self.described = describe_connector(connector, name or type(connector).__name__)
        self._names: dict[int, str] = {}
        self.bind_caches(kv_caches)
        self._metadata: Any = None
        self._step_req_ids: set[str] = set()
        self._failures: dict[str, str] = {}
        self._load_broken = False
        self._save_broken = False

    def bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """(Re)register the cache tensors: at start-up and after a wake-up reallocates them."""
        self._names = {cache.data_ptr(): layer_name(i) for i, cache in enumerate(kv_caches)}
        self.connector.register_kv_caches({layer_name(i): c for i, c in enumerate(kv_caches)})

    # --- the step -------------------------------------------------------------------

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        self._metadata = scheduler_output.kv_connector_metadata
        self._step_req_ids = set(scheduler_output.num_scheduled_tokens)
        self._load_broken = self._save_broken = False
        try:
            self.connector.start_load_kv(self._metadata)
        except Exception as exc:
            self._load_failed("start_load_kv", exc)

    def wait_for_layer_load(self, kv_cache: torch.Tensor) -> None:
        if self._load_broken:
            return
        try:
            self.connector.wait_for_layer_load(self._names[kv_cache.data_ptr()])
        except Exception as exc:
            self._load_failed("wait_for_layer_load", exc)

    def save_layer(self, kv_cache: torch.Tensor) -> None:
        if self._save_broken:
            return
        try:
            self.connector.save_kv_layer(self._names[kv_cache.data_ptr()], kv_cache, self._metadata)
        except Exception as exc:
            self._save_failed("save_kv_layer", exc)

    def end_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """Wait for saves to have copied what they need, then collect finished transfers."""
        connector = self.connector
        if not self._save_broken:
            try:
                connector.wait_for_save()
            except Exception as exc:
                self._save_failed("wait_for_save", exc)
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        invalid: set[int] = set()
        try:
            done_sending, done_recving = connector.get_finished(
                set(scheduler_output.finished_req_ids)
            )
            invalid = set(connector.get_block_ids_with_load_errors())
            for req_id, message in connector.get_failures().items():
                self._failures.setdefault(req_id, message)
        except Exception as exc:
            # Without an answer nothing is known finished: fail what this step touched.
            self._fail(self._step_req_ids, "get_finished", exc)
        failures, self._failures = self._failures, {}
        self._metadata = None
        try:
            rejected = int(connector.get_num_rejected_messages())
        except Exception:
            logger.exception("%s: get_num_rejected_messages raised", self.described)
            rejected = 0
        return KVConnectorOutput(
            finished_sending=set(done_sending or ()),
            finished_recving=set(done_recving or ()),
            invalid_block_ids=invalid,
            failures=failures,
            num_rejected_messages=rejected,
        )

    def shutdown(self) -> None:
        self.connector.shutdown()

    # --- failures -------------------------------------------------------------------

    def _affected(self, attribute: str) -> set[str]:
        named = getattr(self._metadata, attribute, None)
        if named is None:
            return set(self._step_req_ids)
        return set(named)

    def _load_failed(self, where: str, exc: Exception) -> None:
        self._load_broken = True
        self._fail(self._affected("load_request_ids"), where, exc)

    def _save_failed(self, where: str, exc: Exception) -> None:
        self._save_broken = True
        self._fail(self._affected("save_request_ids"), where, exc)

    def _fail(self, req_ids: set[str], where: str, exc: Exception) -> None:
        name = type(self.connector).__name__
        message = f"{name}.{where} raised {type(exc).__name__}: {exc} ({self.described})"
        logger.error("%s (requests: %s)", message, sorted(req_ids))
        for req_id in req_ids:
            self._failures.setdefault(req_id, message)
