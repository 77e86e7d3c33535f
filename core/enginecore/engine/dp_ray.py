"""Data parallelism on Ray: each engine-core replica is a Ray actor in its own placement group.

A replica's placement group holds everything that replica runs, on one node
(``STRICT_PACK``): bundle 0 is the engine core; with the ``ray`` executor, bundles
1..world_size are its TP x PP ranks (the executor finds them through the captured
placement group), otherwise bundle 0 is sized for the whole world size (``uni``/``mp``
run the ranks inside or beside the engine-core process). Replicas are spread over the
cluster's nodes round-robin (a soft target node per placement group), so two replicas on
a two-node cluster land on different nodes.

The engine core runs inside the actor's process (``run_engine_core`` on an actor
thread), connected to the frontend over ZeroMQ TCP sockets the frontend binds on
``parallel.data_parallel_host``; startup, outputs, utilities and the death sentinel are
the same messages as with local processes. Liveness is the actor itself: the ``run``
call only ends when the engine stops, so a finished (or failed) ``run`` means the
replica is gone, even when it died by SIGKILL and could not say so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from enginecore.config import EngineConfig
from enginecore.engine.mp_client import _EngineProcess
from enginecore.engine.wire_auth import CurveKeys, authenticator_for, secure_server
from enginecore.errors import ConfigError, EngineCoreError
from enginecore.placement import check_replicas_fit
from enginecore.protocol import EngineCoreRequestType
from enginecore.serial import MsgpackEncoder

logger = logging.getLogger(__name__)

_generations = itertools.count()

_ANY_HOST = ("0.0.0.0", "::", "*", "")


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            "data_parallel_backend 'ray' needs Ray: pip install 'enginecore[ray]'"
        ) from exc
    return ray


def ensure_ray(config: EngineConfig) -> bool:
    """Connect to ``parallel.ray_address`` or start a private local cluster (bound to
    127.0.0.1). Returns True when this call started Ray (so closing should stop it)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    par = config.parallel
    if par.ray_address:
        ray.init(address=par.ray_address, log_to_driver=True)
    else:
        cpus = sum(_bundle_cpus(b) for b in replica_bundles(config, use_gpu=False))
        ray.init(
            num_cpus=cpus * par.data_parallel_size,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
        )
    return True


def _bundle_cpus(bundle: dict[str, float]) -> float:
    return bundle.get("CPU", 0.0)


def replica_bundles(config: EngineConfig, *, use_gpu: bool) -> list[dict[str, float]]:
    """The resources of one replica: bundle 0 for the engine core (and its in-process or
    ``mp`` ranks), then one bundle per rank when the replica's executor is ``ray``."""
    world = config.parallel.world_size
    if config.parallel.executor == "ray":
        rank = {"CPU": 1.0, **({"GPU": 1.0} if use_gpu else {})}
        return [{"CPU": 1.0}] + [dict(rank) for _ in range(world)]
    return [{"CPU": float(world), **({"GPU": float(world)} if use_gpu else {})}]


class EngineCoreActor:
    """The Ray actor one replica's engine core runs in."""

    def info(self) -> tuple[str, int]:
        """``(node id, pid)``: where this replica runs."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(
        self,
        config_bytes: bytes,
        input_address: str,
        output_address: str,
        engine_index: int,
        curve_keys: dict[str, bytes] | None = None,
    ) -> None:
        """Runs the engine core until it stops; returns (or raises) only then.
        ``curve_keys`` (from the frontend, through Ray) authenticate its TCP sockets."""
        from enginecore.engine.core_proc import run_engine_core

        # A startup failure was already reported on the output socket.
        with contextlib.suppress(SystemExit):
            run_engine_core(config_bytes, input_address, output_address, engine_index, curve_keys)


class RayEngine(_EngineProcess):
    """One replica on Ray, with the same interface as a local engine process."""

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context[Any],
        engine_index: int,
        target_node: str | None,
        use_gpu: bool,
        keep_waiting: Callable[[], bool] | None = None,
    ) -> None:
        """``keep_waiting``: wait for the placement as long as it answers True (a replica
        restarted after its node died waits for a node with room to come back); without
        it the wait is bounded by ``ready_timeout``."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray = import_ray()
        self.engine_index = engine_index
        self.generation = next(_generations)  # a restarted replica gets fresh Ray names
        self._run_ref: Any = None
        self.actor: Any = None
        host = config.parallel.data_parallel_host
        connect_host = ray.util.get_node_ip_address() if host in _ANY_HOST else host
        # TCP: CURVE servers that admit only this replica's key (wire_auth.py).
        keys = CurveKeys.new()
        authenticator = authenticator_for(ctx)
        authenticator.allow(keys.client_public)
        self.input_socket = ctx.socket(zmq.PUSH)
        secure_server(self.input_socket, keys)
        authenticator.watch(self.input_socket)
        input_port = self.input_socket.bind_to_random_port(f"tcp://{_bind_host(host)}")
        self.output_socket = ctx.socket(zmq.PULL)
        secure_server(self.output_socket, keys)
        authenticator.watch(self.output_socket)
        output_port = self.output_socket.bind_to_random_port(f"tcp://{_bind_host(host)}")
        bundles = replica_bundles(config, use_gpu=use_gpu)
        self.placement_group = placement_group(
            bundles,
            strategy="STRICT_PACK",
            name=f"enginecore-dp-{engine_index}-{os.getpid()}-{self.generation}",
            _soft_target_node_id=target_node,
        )
        timeout = config.engine.ready_timeout
        try:
            self._wait_placed(bundles, timeout, keep_waiting)
        except BaseException:
            self.close()
            raise
        actor_cls = ray.remote(max_concurrency=2)(EngineCoreActor)
        self.actor = actor_cls.options(
            num_cpus=bundles[0]["CPU"],
            num_gpus=bundles[0].get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True,
            ),
            name=f"enginecore-dp-engine-{engine_index}-{os.getpid()}-{self.generation}",
        ).remote()
        self.node_id, self.pid = ray.get(self.actor.info.remote(), timeout=timeout)
        self._run_ref = self.actor.run.remote(
            msgspec.msgpack.encode(config),
            f"tcp://{connect_host}:{input_port}",
            f"tcp://{connect_host}:{output_port}",
            engine_index,
            keys.for_client(),
        )

    def _wait_placed(
        self,
        bundles: list[dict[str, float]],
        timeout: float,
        keep_waiting: Callable[[], bool] | None,
    ) -> None:
        ready_ref = self.placement_group.ready()
        if keep_waiting is None:
            ready, _ = self.ray.wait([ready_ref], timeout=timeout)
        else:
            ready = []
            while not ready and keep_waiting():
                ready, _ = self.ray.wait([ready_ref], timeout=1.0)
        if not ready:
            raise EngineCoreError(
                f"data-parallel replica {self.engine_index}: the Ray cluster could not place "
                f"{bundles} on one node within {timeout:.0f} s "
                f"(cluster resources: {self.ray.cluster_resources()})"
                if keep_waiting is None
                else f"data-parallel replica {self.engine_index}: restart cancelled"
            )

    def is_alive(self) -> bool:
        if self._run_ref is None:
            return False
        done, _ = self.ray.wait([self._run_ref], timeout=0)
        return not done

    def exit_text(self) -> str:
        reason = "its engine stopped"
        if self._run_ref is not None and not self.is_alive():
            try:
                self.ray.get(self._run_ref, timeout=1)
            except Exception as exc:  # RayActorError when the process was killed
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return f"the engine core actor (pid {self.pid}, node {self.node_id[:12]}) ended: {reason}"

    def early_exit_text(self) -> str:
        return self.exit_text()

    def wait_exit(self, timeout: float) -> None:
        if self._run_ref is not None:
            self.ray.wait([self._run_ref], timeout=timeout)

    def stop(self) -> None:
        """Signals belong to Ray in an actor: shutdown is asked for as a message."""
        if self.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                frames = MsgpackEncoder().encode("shutdown")
                self.input_socket.send_multipart(
                    [EngineCoreRequestType.WAKEUP.value, *frames], flags=zmq.NOBLOCK
                )

    def remove_files(self) -> None:
        """Nothing on this machine: the replica talks over TCP, and on its node the
        executor's workers remove the directories of an engine that is gone."""

    def release(self) -> None:
        """Ends the actor and frees its placement group, so that a restarted replica can
        take the node's resources (a dead node's group would otherwise be re-placed)."""
        from ray.util.placement_group import remove_placement_group

        self.wait_exit(10)
        with contextlib.suppress(Exception):
            if self.actor is not None:
                self.ray.kill(self.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.placement_group)

    def close(self) -> None:
        self.release()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)


def _bind_host(host: str) -> str:
    return "*" if host in _ANY_HOST else host


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def check_frontend_reachable(host: str, node_addresses: list[str], driver_address: str) -> None:
    """A loopback ``data_parallel_host`` is reachable only from this machine: refuse it
    when the cluster has nodes elsewhere (their replicas could never connect back)."""
    if not _is_loopback(host):
        return
    remote = sorted(a for a in set(node_addresses) if not _is_loopback(a) and a != driver_address)
    if remote:
        raise ConfigError(
            f"data_parallel_host={host!r} is reachable from this machine only, but the Ray "
            f"cluster has nodes at {', '.join(remote)} whose replicas must connect back to "
            f"the frontend: set data_parallel_host to an address of this machine they "
            f"reach (this node's is {driver_address}), on a private network"
        )


def replicas_use_gpu(config: EngineConfig) -> bool:
    """Whether each replica's bundles ask for GPUs (the device, or any GPU in the cluster)."""
    ray = import_ray()
    return config.model.device == "cuda" or (
        config.model.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
    )


def start_ray_engines(config: EngineConfig, ctx: zmq.Context[Any]) -> list[RayEngine]:
    """One placement group and actor per replica, spread over the nodes round-robin."""
    ray = import_ray()
    par = config.parallel
    check_frontend_reachable(
        par.data_parallel_host,
        [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")],
        ray.util.get_node_ip_address(),
    )
    use_gpu = replicas_use_gpu(config)
    check_replicas_fit(
        ray.nodes(), replica_bundles(config, use_gpu=use_gpu), par.data_parallel_size
    )
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    engines: list[RayEngine] = []
    try:
        for index in range(par.data_parallel_size):
            target = nodes[index % len(nodes)] if nodes else None
            engines.append(RayEngine(config, ctx, index, target, use_gpu))
    except BaseException:
        for engine in engines:
            engine.stop()
        for engine in engines:
            engine.close()
        raise
    return engines
