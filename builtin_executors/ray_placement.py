"""Where the ``ray`` executor's ranks go on a Ray cluster.

A tensor-parallel group runs a collective in every layer, so it never straddles nodes:
each pipeline stage (one TP group) gets its own placement group of ``tp`` bundles with
``STRICT_PACK``. Stages may sit on different nodes (one point-to-point transfer per step
between neighbours). Ranks are then ordered by node: the stages on the driver's node come
first (rank 0 hosts the rendezvous), then the other nodes' stages by node address, so
neighbouring stages share a node whenever they can.

Before anything is reserved the requested shape is checked against the nodes' total
resources, and an impossible shape fails at once with what is missing; a shape that fits
but finds the cluster busy waits up to ``engine.ready_timeout``.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from enginecore.errors import ConfigError, EngineCoreError


def rank_bundle(use_gpu: bool) -> dict[str, float]:
    """One rank's resources."""
    return {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})}


def _fmt(resources: Mapping[str, float]) -> str:
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
    fits = {n["NodeManagerAddress"]: groups_that_fit(n.get("Resources", {}), group) for n in alive}
    held = sum(fits.values())
    if held >= pp:
        return
    per_node = "; ".join(
        f"{n['NodeManagerAddress']}: {_fmt({k: n.get('Resources', {}).get(k, 0.0) for k in group})}"
        for n in alive
    )
    if held == 0:
        raise ConfigError(
            f"the Ray cluster cannot place tensor_parallel_size={tp}: one TP group needs "
            f"{_fmt(group)} on a single node (a TP group never spans nodes), and no node has "
            f"that (nodes: {per_node or 'none alive'}). Add a node with {_fmt(group)}, or "
            "lower tensor_parallel_size"
        )
    raise ConfigError(
        f"the Ray cluster cannot place pipeline_parallel_size={pp} stages of "
        f"tensor_parallel_size={tp}: each stage needs {_fmt(group)} on one node, and the "
        f"nodes hold {held} such stage(s) in all (nodes: {per_node}). "
        f"{pp - held} more stage(s) need room: add nodes, or lower pipeline_parallel_size"
    )


def order_stages_by_node(
    stage_nodes: Sequence[str], first_node: str | None, node_addresses: Mapping[str, str]
) -> list[int]:
    """Placement groups (by index) in rank order: the driver's node first, then by address;
    within a node, in creation order."""

    def key(index: int) -> tuple[int, str, int]:
        node = stage_nodes[index]
        return (0 if node == first_node else 1, node_addresses.get(node, node), index)

    return sorted(range(len(stage_nodes)), key=key)


@dataclass
class Placement:
    """The placement groups and, per rank, ``(placement group, bundle index)``."""

    groups: list[Any]
    slots: list[tuple[Any, int]]
    owned: bool  # created here (so removed at shutdown), or a data-parallel replica's


def place_ranks(ray: Any, bundle: dict[str, float], tp: int, pp: int, timeout: float) -> Placement:
    """Reserve one STRICT_PACK placement group per pipeline stage, ordered by node."""
    from ray.util.placement_group import placement_group, placement_group_table

    check_shape_fits(ray.nodes(), bundle, tp, pp)
    tag = f"enginecore-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # unique per executor
    groups = [
        placement_group([dict(bundle)] * tp, strategy="STRICT_PACK", name=f"{tag}-stage{s}")
        for s in range(pp)
    ]
    placement = Placement(groups, [], owned=True)
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=pp, timeout=timeout)
        if len(ready) < pp:
            raise EngineCoreError(
                f"the Ray cluster did not free room for {pp - len(ready)} of {pp} pipeline "
                f"stage(s) of {tp} x {{{_fmt(bundle)}}} on one node within {timeout:.0f} s "
                f"(engine.ready_timeout); free now: {_fmt(ray.available_resources())}"
            )
        stage_nodes = [placement_group_table(g)["bundles_to_node_id"][0] for g in groups]
    except BaseException:
        remove_groups(placement)
        raise
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    driver = ray.get_runtime_context().get_node_id()
    for index in order_stages_by_node(stage_nodes, driver, addresses):
        placement.slots.extend((groups[index], b) for b in range(tp))
    return placement


def remove_groups(placement: Placement) -> None:
    """Give the reserved resources back (only groups this executor created)."""
    if not placement.owned:
        return
    from ray.util.placement_group import remove_placement_group

    for group in placement.groups:
        with contextlib.suppress(Exception):  # the cluster may already be gone
            remove_placement_group(group)
