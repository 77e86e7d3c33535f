"""What a Ray cluster can hold: checks of a requested shape against its nodes.

Pure functions over ``ray.nodes()`` records (``Alive``, ``NodeManagerAddress``,
``Resources``; each record one node, even where several share an address), so an impossible shape fails at once, naming what is missing, instead of
waiting for resources that will never come. Used by the ``ray`` executor (a TP group on
one node) and by data parallelism on Ray (a replica on one node).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from enginecore.errors import ConfigError


def format_resources(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()))


def groups_that_fit(node_resources: Mapping[str, float], group: Mapping[str, float]) -> int:
    """How many whole groups of ``group`` resources one node holds."""
    counts = [
        math.floor(node_resources.get(key, 0.0) / need + 1e-9)
        for key, need in group.items()
        if need > 0
    ]
    return min(counts) if counts else 0


def check_shape_fits(
    nodes: Sequence[Mapping[str, Any]], bundle: Mapping[str, float], tp: int, pp: int
) -> None:
    """Raise a ConfigError naming what is missing when no placement can exist.

    ``nodes`` are ``ray.nodes()`` records (``Alive``, ``NodeManagerAddress``, ``Resources``).
    """
    group = {key: value * tp for key, value in bundle.items()}
    alive = [n for n in nodes if n.get("Alive")]
    # Per node, not per address: several raylets may share one host's address.
    held = sum(groups_that_fit(n.get("Resources", {}), group) for n in alive)
    if held >= pp:
        return
    per_node = "; ".join(
        f"{n['NodeManagerAddress']}: {format_resources({k: n.get('Resources', {}).get(k, 0.0) for k in group})}"
        for n in alive
    )
    if held == 0:
        raise ConfigError(
            f"the Ray cluster cannot place tensor_parallel_size={tp}: one TP group needs "
            f"{format_resources(group)} on a single node (a TP group never spans nodes), and no node has "
            f"that (nodes: {per_node or 'none alive'}). Add a node with {format_resources(group)}, or "
            "lower tensor_parallel_size"
        )
    raise ConfigError(
        f"the Ray cluster cannot place pipeline_parallel_size={pp} stages of "
        f"tensor_parallel_size={tp}: each stage needs {format_resources(group)} on one node, and the "
        f"nodes hold {held} such stage(s) in all (nodes: {per_node}). "
        f"{pp - held} more stage(s) need room: add nodes, or lower pipeline_parallel_size"
    )


def check_replicas_fit(
    nodes: Sequence[Mapping[str, Any]], bundles: Sequence[Mapping[str, float]], replicas: int
) -> None:
    """Data parallelism on Ray: each replica's bundles share one node (``STRICT_PACK``);
    raise a ConfigError naming what is missing when the nodes cannot hold them all."""
    whole: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            whole[key] = whole.get(key, 0.0) + value
    alive = [n for n in nodes if n.get("Alive")]
    held = sum(groups_that_fit(n.get("Resources", {}), whole) for n in alive)
    if held >= replicas:
        return
    per_node = "; ".join(
        f"{n['NodeManagerAddress']}: {format_resources({k: n.get('Resources', {}).get(k, 0.0) for k in whole})}"
        for n in alive
    )
    raise ConfigError(
        f"the Ray cluster cannot place data_parallel_size={replicas}: each replica needs "
        f"{format_resources(whole)} on one node (its engine core and its ranks), and the nodes hold "
        f"{held} such replica(s) (nodes: {per_node or 'none alive'}). Add nodes, or lower "
        "data_parallel_size, tensor_parallel_size or pipeline_parallel_size"
    )
