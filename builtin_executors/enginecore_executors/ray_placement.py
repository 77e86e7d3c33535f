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
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from enginecore.errors import EngineCoreError
from enginecore.placement import check_shape_fits, format_resources


def rank_bundle(use_gpu: bool) -> dict[str, float]:
    """One rank's resources."""
    return {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})}


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
                f"stage(s) of {tp} x {{{format_resources(bundle)}}} on one node within {timeout:.0f} s "
                f"(engine.ready_timeout); free now: {format_resources(ray.available_resources())}"
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
