"""What crosses the executor <-> worker RPC channel, and the errors it reports.

A call is ``(call_id, method, args, kwargs, reply_rank)``; a reply is ``(call_id, rank,
ok, payload)``. Both are pickled (protocol 5): the channel is private to one deployment
(IPC sockets in a 0700 directory) and carries msgspec structs (SchedulerOutput,
ModelRunnerOutput) that pickle natively. A callable ``method`` is cloudpickled on its own
so that lambdas and closures from a notebook reach the ranks.

Only control messages travel here: tensors cross ranks through torch.distributed. The
one exception is the output rank's ModelRunnerOutput (token ids, and logprobs as
lists) coming back to the scheduler. Ranks other than ``reply_rank`` answer with an
empty acknowledgement, so the executor knows every rank finished without shipping their
(identical) results.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
from collections.abc import Callable
from typing import Any

import cloudpickle

from enginecore.errors import EngineCoreError, EngineDeadError, EngineShutdownError
from enginecore.errors import RankError as RankError  # also importable here, as it was

#: call ids below zero are control messages
CALL_READY = -1
CALL_SHUTDOWN = -2

_CALLABLE_TAG = "__enginecore_callable__"


class WorkerStartupError(EngineCoreError):
    """A rank failed to start (bad weights, import error in a plugin, OOM, crash)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} failed to start: {reason}")
        self.rank = rank


class WorkerDiedError(EngineDeadError):
    """A rank's process died; every in-flight call fails with this."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


def method_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def check_reply_rank(unique_reply_rank: int | None, world_size: int) -> None:
    """The one rank asked to reply must exist: a rank outside the world would never answer."""
    if unique_reply_rank is not None and not 0 <= unique_reply_rank < world_size:
        raise ValueError(
            f"unique_reply_rank {unique_reply_rank} is outside world size {world_size}"
        )


class CallGate:
    """What every executor checks before it sends a collective_rpc call: the ranks are
    alive, the executor is open, and the one rank asked to reply exists."""

    world_size: int
    _dead: str | None
    _dead_rank: int | None
    _closing: bool

    def _admit_call(self, method: str | Callable[..., Any], unique_reply_rank: int | None) -> str:
        """The call's name, once it may be sent; raises the error that says why not."""
        name = method_name(method)
        if self._dead is not None:
            raise WorkerDiedError(f"executor failed: {self._dead}", self._dead_rank)
        if self._closing:
            raise EngineShutdownError(f"collective_rpc {name!r}: the executor is shut down")
        check_reply_rank(unique_reply_rank, self.world_size)
        return name


def describe_exit(rank: int, pid: int, code: int | None) -> str:
    """``rank 1 (pid 123) died with exit code -9 (SIGKILL)``."""
    text = f"rank {rank} (pid {pid}) died with exit code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            text += f" ({signal.Signals(-code).name})"
    return text


def encode_call(
    call_id: int,
    method: str | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    reply_rank: int | None,
) -> bytes:
    wire_method: Any = method
    if callable(method):
        wire_method = (_CALLABLE_TAG, cloudpickle.dumps(method, protocol=5))
    payload = pickle.dumps((args, kwargs or {}), protocol=5)
    return pickle.dumps((call_id, wire_method, payload, reply_rank), protocol=5)


def decode_call(data: bytes) -> tuple[int, Any, bytes, int | None]:
    """``(call_id, method, payload, reply_rank)``; the payload and a callable method are
    unpickled by :func:`load_call` (inside the rank's error handling: a closure that
    cannot be unpickled on a rank is that call's error, not the rank's death)."""
    call: tuple[int, Any, bytes, int | None] = pickle.loads(data)
    return call


def load_call(method: Any, payload: bytes) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    if isinstance(method, tuple) and method and method[0] == _CALLABLE_TAG:
        method = pickle.loads(method[1])
    args, kwargs = pickle.loads(payload)
    return method, args, kwargs


def encode_reply(call_id: int, rank: int, ok: bool, payload: Any) -> bytes:
    try:
        return pickle.dumps((call_id, rank, ok, payload), protocol=5)
    except Exception as exc:  # a result that cannot be pickled becomes this rank's error
        text = f"could not send the result back: {type(exc).__name__}: {exc}"
        return pickle.dumps((call_id, rank, False, text), protocol=5)


def decode_reply(data: bytes) -> tuple[int, int, bool, Any]:
    reply: tuple[int, int, bool, Any] = pickle.loads(data)
    return reply
