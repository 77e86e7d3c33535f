"""Where a rank sits in the tensor/pipeline-parallel layout, and setting that layout up.

Ranks are laid out pipeline-major: ``rank = pp_rank * tp_size + tp_rank``. Each pipeline
stage is one tensor-parallel group of consecutive ranks; a pipeline group joins the ranks
with the same ``tp_rank`` across stages. The last stage's TP rank 0 is the *output rank*:
it samples and its ModelRunnerOutput is the one the scheduler sees.

torch is imported lazily: the frontend and the scheduler never need it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import socket
import sys
from dataclasses import dataclass
from typing import Any

from enginecore.config import ParallelConfig


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the parallel layout. ``tp_group``/``pp_group`` are
    torch.distributed groups (None when that size is 1)."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None

    @property
    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        return output_rank(self.tp_size, self.pp_size)

    @property
    def prev_pp_rank(self) -> int:
        """Global rank of the same TP rank in the previous stage."""
        return self.rank - self.tp_size

    @property
    def next_pp_rank(self) -> int:
        return self.rank + self.tp_size


SINGLE_RANK = ParallelContext()


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose ModelRunnerOutput the engine uses: TP rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def layout(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """``(tp_rank, pp_rank)`` of a global rank."""
    if not 0 <= rank < tp_size * pp_size:
        raise ValueError(f"rank {rank} is outside world size {tp_size * pp_size}")
    return rank % tp_size, rank // tp_size


#: Set by the frontend in each local data-parallel replica's environment.
REPLICA_ENV = "ENGINECORE_DATA_PARALLEL_REPLICA"


def local_replica_index() -> int:
    """This process's local data-parallel replica (0 when it is not one of several)."""
    value = os.environ.get(REPLICA_ENV, "")
    return int(value) if value.isdigit() else 0


def replica_env(par: ParallelConfig, replica: int) -> dict[str, str]:
    """Environment additions for local replica ``replica``'s engine process."""
    if par.data_parallel_size <= 1 or par.data_parallel_backend != "mp":
        return {}
    return {REPLICA_ENV: str(replica)}


#: Listening sockets this process bound for a TCP rendezvous it hosts, by init_method.
_HELD_RENDEZVOUS: dict[str, socket.socket] = {}


def hold_rendezvous_port(ip: str) -> str:
    """Bind a listening socket on ``ip`` only and return its ``tcp://`` init_method: the
    rank that hosts the rendezvous (this process) hands it to torch's TCP store, which
    would otherwise listen on every interface whatever address it is given."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(128)
    host = f"[{ip}]" if family == socket.AF_INET6 else ip
    init_method = f"tcp://{host}:{sock.getsockname()[1]}"
    _HELD_RENDEZVOUS[init_method] = sock
    return init_method


def _held_store(init_method: str, world_size: int, timeout: Any) -> Any:
    """The TCP store on the socket ``hold_rendezvous_port`` bound here, or None."""
    sock = _HELD_RENDEZVOUS.pop(init_method, None)
    if sock is None:
        return None
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    host, port = sock.getsockname()[:2]
    store = TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())
    # The prefix torch puts on the store it makes from an init_method (the other ranks').
    return PrefixStore("default_pg", store)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous of one executor's ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def resolve_device_type(wanted: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``model.device`` setting; ``auto`` is CUDA when
    torch sees a device. A CPU-only torch build is told from its version file, so the
    engine process of a CPU server never imports torch (over a second of its start)."""
    if wanted != "auto":
        return wanted
    if "torch" not in sys.modules and not torch_built_for_gpu():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_built_for_gpu() -> bool:
    """Whether the installed torch was built with CUDA or ROCm, read from
    ``torch/version.py`` without importing torch; True when that cannot be told."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    version_file = pathlib.Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(version_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return True
    built: dict[str, object] = {}
    for node in tree.body:
        targets: list[ast.expr] = [node.target] if isinstance(node, ast.AnnAssign) else []
        if isinstance(node, ast.Assign):
            targets = node.targets
        value = getattr(node, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                built[target.id] = value.value
    if "cuda" not in built or "hip" not in built:
        return True
    return built["cuda"] is not None or built["hip"] is not None


def resolve_backend(wanted: str, device_type: str) -> str:
    if wanted != "auto":
        return wanted
    return "nccl" if device_type == "cuda" else "gloo"


def init_distributed(
    *,
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str,
    timeout_s: float = 600.0,
) -> ParallelContext:
    """Join the process group and build the TP and PP groups; returns this rank's context.

    Every rank must call this with the same sizes: ``new_group`` is itself collective and
    every rank creates every group, in the same order.
    """
    import datetime

    import torch.distributed as dist

    world_size = tp_size * pp_size
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _held_store(init_method, world_size, timeout) if rank == 0 else None
        if store is not None:
            dist.init_process_group(
                backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
    elif dist.get_world_size() != world_size:
        raise RuntimeError(
            f"torch.distributed is already initialized with world size "
            f"{dist.get_world_size()}, but the config asks for tp*pp = {world_size}"
        )
    tp_rank, pp_rank = layout(rank, tp_size, pp_size)
    tp_group = pp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = group
    for t in range(tp_size):
        ranks = [t + s * tp_size for s in range(pp_size)]
        group = dist.new_group(ranks) if pp_size > 1 else None
        if t == tp_rank:
            pp_group = group
    return ParallelContext(
        rank=rank,
        world_size=world_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        tp_group=tp_group,
        pp_group=pp_group,
    )


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
