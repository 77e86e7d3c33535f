"""Resolve the config's component names against the plugin registries, once, at start-up."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from enginecore.config import EngineConfig
from enginecore.distributed import resolve_device_type
from enginecore.interfaces import Scheduler, WorkerSpec
from enginecore.plugins import PluginHost

WORKER_REF = "enginecore_executors.worker:Worker"


@dataclass
class Components:
    """The selected implementation of each component kind and the plugin that provides it."""

    executor_name: str
    executor_cls: type
    scheduler_cls: type[Scheduler]
    policy_cls: type
    worker_spec: WorkerSpec
    providers: dict[str, str]  # "kind" -> "name (from plugin)"


def pick_executor_name(config: EngineConfig) -> str:
    """``auto``: ``mp`` for several ranks; for one, ``uni`` (in the engine process) unless
    it computes on CPU with cores reserved for the frontend (``enginecore serve``).

    A CPU forward pass holds the GIL between its ops, so in the engine process it takes
    turns with the scheduler and the output serialization; in a worker process those run
    on the reserved core beside it (TPOT at 8 req/s on the tiny model: ~4 ms against
    ~7 ms, ``enginecore bench serve``). Offline, with no core to spare, the two are even.
    """
    name = config.parallel.executor
    if name != "auto":
        return name
    if config.parallel.world_size > 1:
        return "mp"
    if (config.parallel.cpu_reserved_cores or 0) > 0 and (
        resolve_device_type(config.model.device) == "cpu"
    ):
        return "mp"
    return "uni"


def checkpoint_architecture(path: str, models: Any) -> str | None:
    """The first registered name in the checkpoint's ``config.json`` ``architectures``
    (the one the model runner will build), or None when it cannot tell cheaply."""
    config_json = pathlib.Path(path) / "config.json" if path else None
    if config_json is None or not config_json.is_file():
        return None
    try:
        architectures = json.loads(config_json.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return next((a for a in architectures if a in models), None)


def resolve_components(config: EngineConfig, host: PluginHost) -> Components:
    """Look up every selected name; an unknown one fails here, before anything loads."""
    providers: dict[str, str] = {}

    def pick(kind: str, name: str) -> Any:
        registry = host.registry(kind)
        entry = registry.entry(name)
        providers[kind] = f"{name} (from {entry.plugin})"
        return registry.get(name)

    executor_name = pick_executor_name(config)
    executor_cls = pick("executor", executor_name)
    scheduler_cls = pick("scheduler", config.scheduler.name)
    policy_cls = pick("scheduling_policy", config.scheduler.policy)
    runner_entry = host.registry("model_runner").entry(config.model.runner)
    providers["model_runner"] = f"{config.model.runner} (from {runner_entry.plugin})"
    models = host.registry("model")
    architecture = checkpoint_architecture(config.model.path, models)
    if architecture is not None:
        providers["model"] = f"{architecture} (from {models.entry(architecture).plugin})"
    backend_refs = {}
    for kind, selected in (
        ("attention_backend", config.model.attention_backend),
        ("linear_method", config.model.linear_method),
    ):
        registry = host.registry(kind)
        if selected != "auto":
            entry = registry.entry(selected)  # an unknown name fails here, listing the known
            providers[kind] = f"{selected} (from {entry.plugin})"
        backend_refs[kind] = {name: registry.entry(name).ref for name in registry}
    kv_ref = None
    if config.kv_transfer.connector:
        kv_entry = host.registry("kv_connector").entry(config.kv_transfer.connector)
        providers["kv_connector"] = f"{kv_entry.name} (from {kv_entry.plugin})"
        kv_ref = kv_entry.ref
    # Stat loggers run in the frontend, which checked their names (and may hold one
    # registered in-process only): here they are only named.
    stat_loggers = host.registry("stat_logger")
    if config.observability.stat_loggers:
        providers["stat_loggers"] = ", ".join(
            f"{n} (from {stat_loggers.entry(n).plugin})" if n in stat_loggers else n
            for n in config.observability.stat_loggers
        )
    proposer_ref = None
    if config.speculative.speculative_method is not None:
        proposer = host.registry("spec_decode_proposer").entry(
            config.speculative.speculative_method
        )
        providers["spec_decode_proposer"] = f"{proposer.name} (from {proposer.plugin})"
        proposer_ref = proposer.ref
    worker_spec = WorkerSpec(
        worker_ref=WORKER_REF,
        model_runner_ref=runner_entry.ref,
        model_refs={name: models.entry(name).ref for name in models},
        worker_rpc_refs={
            name: host.registry("worker_rpc").entry(name).ref
            for name in host.registry("worker_rpc")
        },
        kv_connector_ref=kv_ref,
        enabled_plugins=config.plugins.enabled,
        disabled_plugins=list(config.plugins.disabled),
        spec_decode_proposer_ref=proposer_ref,
        attention_backend_refs=backend_refs["attention_backend"],
        linear_method_refs=backend_refs["linear_method"],
    )
    return Components(
        executor_name=executor_name,
        executor_cls=executor_cls,
        scheduler_cls=scheduler_cls,
        policy_cls=policy_cls,
        worker_spec=worker_spec,
        providers=providers,
    )
