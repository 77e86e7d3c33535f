"""Worker RPCs that use only the worker attributes docs/plugins.md lists."""

import enginecore

plugin_api_versions = ">=1.0,<2"


def parameter_count(worker) -> int:
    """Parameters of this rank's model (its shard under tensor parallelism)."""
    return sum(p.numel() for p in worker.model_runner.model.parameters())


def rank_identity(worker) -> dict:
    return {
        "rank": worker.rank,
        "device": str(worker.device),
        "tp": [worker.parallel.tp_rank, worker.parallel.tp_size],
        "model": worker.config.model.path,
    }


@enginecore.hookimpl
def register_worker_rpcs(registry):
    registry.add("parameter_count", parameter_count, summary="parameters of this rank's model")
    registry.add("rank_identity", rank_identity, summary="rank, device and TP position")
