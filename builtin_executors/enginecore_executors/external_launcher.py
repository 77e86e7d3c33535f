"""The ``external_launcher`` executor: SPMD under ``torchrun``.

``torchrun --nproc-per-node N script.py`` starts N copies of the user's script. Each one
builds a complete engine (in-process: ``InprocClient``, no engine process) whose executor
holds exactly one worker -- this process's rank -- in the TP/PP group that torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) describes.

There is no broadcast: every rank runs its own scheduler and they never exchange
SchedulerOutputs. That is only correct because the built-in scheduler is deterministic
by construction (decisions depend on arrival sequence numbers, priorities and token
counts, never on wall-clock time or hash order), so identical engines fed identical
requests plan identical steps. ``tests/executors/test_external_launcher.py`` proves it step by
step with a real ``torchrun``. The sampled tokens are broadcast from the output rank
inside the model runner, so every rank also holds identical outputs.

``collective_rpc`` reaches only this process's worker: the result list has one entry.
"""

from __future__ import annotations

import os
from typing import Any

from enginecore.errors import ConfigError
from enginecore.registry import import_ref
from enginecore_executors.uniproc import UniProcExecutor

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ExternalLauncherExecutor(UniProcExecutor):
    """One in-process worker per torchrun rank."""

    def _build_worker(self, plugin_host: Any) -> Any:
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ConfigError(
                "executor 'external_launcher' runs under torchrun (or another launcher that "
                f"sets {', '.join(TORCHRUN_VARS)}); missing: {', '.join(missing)}"
            )
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != self.config.parallel.world_size:
            raise ConfigError(
                f"torchrun started {world_size} processes but tensor_parallel_size * "
                f"pipeline_parallel_size = {self.config.parallel.world_size}"
            )
        worker_cls = import_ref(self.worker_spec.worker_ref)
        return worker_cls(
            self.config,
            self.worker_spec,
            rank=rank,
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            plugin_host=plugin_host,
            distributed_init_method="env://",
        )
