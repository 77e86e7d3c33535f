"""A Ray cluster of several nodes on one machine, for tests and benchmarks.

Each node is a real ``ray start --block`` (its own raylet, object store and workers) with
its own node address on the loopback network (``127.0.0.2``, ``127.0.0.3``, ...: Linux
routes all of 127.0.0.0/8 to ``lo``; the head, started on ``127.0.0.1``, is given the
machine's own address by Ray, as a real head would have), its own temporary directory, a
logical CPU count and a resource naming it (``{"enginecore_node_<name>": 1}``). The node processes live in their own session, so
:meth:`SimulatedRayCluster.stop` ends exactly them, never another Ray on the machine
(``ray stop`` would stop every one). :meth:`kill_node` SIGKILLs one node's processes, as
a machine loss would.

What this does not simulate: separate kernels and network stacks (so no packet loss,
latency or bandwidth limits between nodes), separate GPUs, or separate file systems.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: A lost node is declared dead within ~3 s (Ray's defaults take ~30 s on a real cluster).
HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class SimulatedNode:
    name: str
    ip: str
    num_cpus: float
    proc: subprocess.Popen[bytes]
    temp_dir: str

    @property
    def resource(self) -> str:
        return f"enginecore_node_{self.name}"


@dataclass
class SimulatedRayCluster:
    """``with SimulatedRayCluster([("a", 2), ("b", 2)]) as cluster: ... cluster.address``"""

    nodes_spec: list[tuple[str, float]]
    object_store_bytes: int = 80 * 1024 * 1024
    start_timeout: float = 60.0
    nodes: list[SimulatedNode] = field(default_factory=list)
    address: str = ""
    #: Ray reads its authentication mode once per process, from the environment, and a
    #: shared ``~/.ray/auth_token`` would switch new nodes to token mode behind the drivers'
    #: back: the mode is set explicitly (off: every node and driver is on this machine's
    #: loopback; a real cluster runs ``RAY_AUTH_MODE=token`` everywhere).
    auth_env: dict[str, str] = field(default_factory=lambda: {"RAY_AUTH_MODE": "disabled"})
    #: Every node on 127.0.0.1 (several raylets sharing one host's address, as Ray's own
    #: test clusters run) instead of an address each.
    shared_address: bool = False

    def __enter__(self) -> SimulatedRayCluster:
        try:
            for index, (name, cpus) in enumerate(self.nodes_spec):
                ip = "127.0.0.1" if self.shared_address else f"127.0.0.{index + 1}"
                self.add_node(name, cpus, ip=ip)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- nodes ------------------------------------------------------------------------------

    def add_node(self, name: str, num_cpus: float, ip: str) -> SimulatedNode:
        head = not self.nodes
        temp_dir = tempfile.mkdtemp(prefix=f"ecray-{name}-")
        args = [
            _ray_cli(),
            "start",
            "--block",
            f"--node-ip-address={ip}",
            f"--num-cpus={num_cpus:g}",
            "--num-gpus=0",
            f'--resources={{"enginecore_node_{name}": 1}}',
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={temp_dir}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--dashboard-agent-listen-port={_free_port(ip)}",
            "--disable-usage-stats",
        ]
        if head:
            port = _free_port("")  # the GCS listens on every interface
            args += [
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--system-config={json.dumps(HEALTH_CHECKS)}",
            ]
            self.address = f"{ip}:{port}"
        else:
            args.append(f"--address={self.address}")
        env = {**os.environ, **self.auth_env, "RAY_USAGE_STATS_ENABLED": "0"}
        proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped as one
            env=env,
        )
        node = SimulatedNode(name, ip, num_cpus, proc, temp_dir)
        self.nodes.append(node)
        self._wait_alive(len(self.nodes))
        return node

    def _wait_alive(self, count: int) -> None:
        """Until ``count`` nodes are alive, asked of the head's GCS by a short-lived
        driver (this process stays free to ``ray.init`` wherever it likes)."""
        code = (
            "import sys, time, ray\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            f"deadline = time.monotonic() + {self.start_timeout}\n"
            "while time.monotonic() < deadline:\n"
            f"    if sum(n['Alive'] for n in ray.nodes()) >= {count}: sys.exit(0)\n"
            "    time.sleep(0.3)\n"
            "sys.exit(3)\n"
        )
        waiter = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.DEVNULL,
            env={**os.environ, **self.auth_env},
        )
        try:
            while waiter.poll() is None:
                for node in self.nodes:
                    if node.proc.poll() is not None:
                        raise RuntimeError(
                            f"ray node {node.name} ({node.ip}) exited with code "
                            f"{node.proc.returncode} (logs under {node.temp_dir})"
                        )
                time.sleep(0.3)
        finally:
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
        if waiter.returncode != 0:
            raise TimeoutError(
                f"{count} Ray node(s) were not alive within {self.start_timeout} s "
                f"(the waiter exited with code {waiter.returncode})"
            )

    def node(self, name: str) -> SimulatedNode:
        return next(n for n in self.nodes if n.name == name)

    def node_processes(self, name: str) -> list[int]:
        """The pids of one node's processes now (raylet, object store, workers, actors)."""
        return _descendants(self.node(name).proc.pid)

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of one node (raylet, object store, its workers)."""
        node = self.node(name)
        tree = _descendants(node.proc.pid)  # raylet, object store, workers, actors
        _kill_group(node.proc, signal.SIGKILL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _kill_stragglers(node.temp_dir)

    def restart_node(self, name: str) -> SimulatedNode:
        """Start a node again under the same name and address (a machine coming back)."""
        node = self.node(name)
        self.nodes.remove(node)
        shutil.rmtree(node.temp_dir, ignore_errors=True)
        return self.add_node(name, node.num_cpus, node.ip)

    def stop(self) -> None:
        """End every node this cluster started (workers first, the head last)."""
        for node in reversed(self.nodes):
            tree = _descendants(node.proc.pid)
            _kill_group(node.proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(15)
            _kill_group(node.proc, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            _kill_stragglers(node.temp_dir)
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        self.nodes.clear()


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    if sig == signal.SIGKILL:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` now (Ray's workers may leave its process group)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _kill_stragglers(temp_dir: str) -> None:
    """Processes of this node that left its process group (they name its temp dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if temp_dir.encode() in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
