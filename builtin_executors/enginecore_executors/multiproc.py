"""The ``mp`` executor: one worker process per rank on this machine.

Channels (ZeroMQ over IPC sockets in a private 0700 directory):

- **broadcast** (engine -> all ranks): one XPUB socket; every rank SUBscribes. A call is
  serialized once and the kernel fans it out. XPUB (rather than PUB) lets start-up wait
  until every rank's subscription has arrived, so the first call cannot be lost to
  ZeroMQ's slow-joiner window.
- **responses** (all ranks -> engine): every rank PUSHes to one PULL socket; a thread
  matches replies to the pending call's Future by call id.

Why ZeroMQ rather than a shared-memory ring buffer: the calls are control messages (one
``execute_model`` and one ``sample_tokens`` per step, tensors never ride here), so the
~100 us a ZeroMQ round trip costs is small next to a forward pass, and ZeroMQ gives
framing, back-pressure and clean teardown when a peer dies for free. A shared-memory
ring (what vLLM uses) saves tens of microseconds per call and needs spin-waiting readers
and its own liveness protocol; it can replace this channel behind the same class if
``benchmarks/collective_rpc.py`` ever shows the channel matters.

Death chain: a monitor thread waits on every worker's pidfd. When a rank dies it fails
every pending call with :class:`WorkerDiedError` (so a step blocked on a Future wakes
at once) and calls the failure callbacks with ``rank N (pid P) died with exit code X``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from enginecore.config import EngineConfig
from enginecore.errors import EngineShutdownError, RankError
from enginecore.interfaces import Executor, WorkerSpec
from enginecore.openmp import child_env
from enginecore.runtime_dirs import make_runtime_dir
from enginecore_executors.rpc import (
    CALL_READY,
    CALL_SHUTDOWN,
    CallGate,
    WorkerDiedError,
    WorkerStartupError,
    decode_reply,
    describe_exit,
    encode_call,
)

logger = logging.getLogger(__name__)

WORKER_MODULE = "enginecore_executors.mp_worker"


@dataclass
class _PendingCall:
    future: Future[Any]
    method: str
    reply_rank: int | None
    remaining: set[int]
    results: dict[int, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


#: Calls the execute_timeout watchdog times: the per-step ones.
WATCHED_METHODS = frozenset({"execute_model", "sample_tokens"})


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (state T in /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # already settled (e.g. failed by the monitor first)


def _kill_all(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Stop every worker process: wait ``grace`` s, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for sig_fn in ("terminate", "kill"):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            return
        for proc in alive:
            getattr(proc, sig_fn)()
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(2.0)


class MultiprocExecutor(CallGate, Executor):
    """One spawned process per rank; collective_rpc is broadcast once and answered by all."""

    #: seconds a rank error waits for a peer's death to be noticed (see _on_error)
    DEATH_GRACE_S = 0.3

    def __init__(self, config: EngineConfig, worker_spec: WorkerSpec, plugin_host: Any = None):
        super().__init__(config, worker_spec)
        par = config.parallel
        self.world_size = par.world_size
        if config.scheduler.async_scheduling:
            # Enough batches in flight to keep every pipeline stage busy.
            self.max_concurrent_batches = max(2, par.pipeline_parallel_size)
        self._lock = threading.Lock()
        self._pending: dict[int, _PendingCall] = {}
        self._next_call_id = 0
        self._dead: str | None = None
        self._dead_rank: int | None = None
        self._closing = False
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = []
        self._dir = make_runtime_dir("mp-")  # mode 0700
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(f"ipc://{self._dir}/broadcast")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(f"ipc://{self._dir}/responses")
        self._wake_r, self._wake_w = os.pipe()
        self._finalizer = weakref.finalize(self, _kill_all, self.procs, 0.0)
        try:
            self._start_workers()
        except BaseException:
            self._closing = True
            _kill_all(self.procs, 0.0)
            self._close_channels()
            raise
        self._response_thread = threading.Thread(
            target=self._response_loop, name="enginecore-mp-responses", daemon=True
        )
        self._response_thread.start()
        self._monitor_thread = threading.Thread(
            target=self._monitor_loop, name="enginecore-mp-monitor", daemon=True
        )
        self._monitor_thread.start()

    # --- start-up ---------------------------------------------------------------------------

    def _start_workers(self) -> None:
        # A file store in the owner-only directory: a TCP store would listen on every
        # interface, unauthenticated, whatever address it is given.
        init_method = f"file://{self._dir}/rendezvous"
        config_bytes = msgspec.msgpack.encode(self.config)
        spec_bytes = msgspec.msgpack.encode(self.worker_spec)
        for rank in range(self.world_size):
            boot = {
                "rank": rank,
                "local_rank": rank,
                "config": config_bytes,
                "worker_spec": spec_bytes,
                "init_method": init_method,
                "broadcast_address": f"ipc://{self._dir}/broadcast",
                "response_address": f"ipc://{self._dir}/responses",
                "parent_pid": os.getpid(),
            }
            # In a process group of its own: a terminal's Ctrl-C (sent to the foreground
            # group) would reach it even while the interpreter starts, before any handler;
            # the engine stops it, and it exits on its own when the engine is gone. Its
            # OpenMP threads sleep when idle (enginecore.openmp) unless the user chose.
            proc = subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE],
                stdin=subprocess.PIPE,
                env=child_env(),
                close_fds=True,
                process_group=0,
            )
            self.procs.append(proc)
            assert proc.stdin is not None  # stdin=PIPE
            proc.stdin.write(pickle.dumps(boot, protocol=5))
            proc.stdin.close()
        self._wait_until_ready()
        self.pids = [p.pid for p in self.procs]

    def _wait_until_ready(self) -> None:
        """Every rank READY and subscribed, or the first rank that failed, and why."""
        ready: set[int] = set()
        subscribed = 0
        timeout = self.config.engine.ready_timeout
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        while len(ready) < self.world_size or subscribed < self.world_size:
            events = dict(poller.poll(100))
            if self._pub in events and self._pub.recv()[:1] == b"\x01":
                subscribed += 1
            if self._pull in events:
                call_id, rank, ok, payload = decode_reply(self._pull.recv())
                if call_id == CALL_READY:
                    if not ok:
                        raise WorkerStartupError(rank, payload)
                    ready.add(rank)
                continue
            for rank, proc in enumerate(self.procs):
                code = proc.poll()
                if code is not None and rank not in ready:
                    raise WorkerStartupError(
                        rank, f"process {proc.pid} exited with code {code} before it was ready"
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise WorkerStartupError(
                    missing[0] if missing else 0,
                    f"not ready after {timeout:.0f} s (engine.ready_timeout); "
                    f"ranks still starting: {missing}",
                )

    # --- calls ------------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Any | Future[Any]:
        name = self._admit_call(method, unique_reply_rank)
        future: Future[Any] = Future()
        with self._lock:
            call_id = self._next_call_id
            self._next_call_id += 1
            data = encode_call(call_id, method, args, kwargs, unique_reply_rank)
            self._pending[call_id] = _PendingCall(
                future, name, unique_reply_rank, set(range(self.world_size))
            )
            self._pub.send(data)
        if non_block:
            return future
        try:
            return future.result(timeout)
        except FutureTimeout:
            with self._lock:
                call = self._pending.pop(call_id, None)
            missing = sorted(call.remaining) if call else []
            raise TimeoutError(
                f"collective_rpc {name!r} timed out after {timeout} s waiting for rank(s) {missing}"
            ) from None

    def _response_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closing:
            try:
                if not poller.poll(200):
                    continue
                data = self._pull.recv()
            except zmq.ZMQError:
                return
            call_id, rank, ok, payload = decode_reply(data)
            with self._lock:
                call = self._pending.get(call_id)
                if call is None:
                    continue  # timed out or failed earlier: a late reply
                if ok:
                    call.results[rank] = payload
                    call.remaining.discard(rank)
                    done = not call.remaining
                else:
                    done = True
                if done:
                    del self._pending[call_id]
            if not ok:
                _settle(call.future, error=self._on_error(rank, call.method, payload))
            elif done:
                if call.reply_rank is not None:
                    _settle(call.future, result=call.results[call.reply_rank])
                else:
                    _settle(call.future, result=[call.results[r] for r in range(self.world_size)])

    def _on_error(self, rank: int, method: str, text: str) -> BaseException:
        """A rank raised. When a peer just died (a collective broke), report the death."""
        if self.world_size > 1:
            deadline = time.monotonic() + self.DEATH_GRACE_S
            while time.monotonic() < deadline and self._dead is None:
                if any(p.poll() is not None for p in self.procs):
                    self._monitor_wake()
                    time.sleep(0.02)
                    break
                time.sleep(0.02)
            dead = [(r, p) for r, p in enumerate(self.procs) if p.poll() is not None]
            if dead and not self._closing:
                r, p = dead[0]
                return WorkerDiedError(describe_exit(r, p.pid, p.returncode), r)
        return RankError(rank, method, text)

    # --- the death chain --------------------------------------------------------------------

    def _monitor_wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _monitor_loop(self) -> None:
        fds: dict[int, int] = {}
        try:
            for rank, proc in enumerate(self.procs):
                fds[os.pidfd_open(proc.pid)] = rank
        except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): poll instead
            fds = {}
        try:
            while not self._closing:
                if fds:
                    select.select([*fds, self._wake_r], [], [], 1.0)
                else:
                    time.sleep(0.1)
                for rank, proc in enumerate(self.procs):
                    if proc.poll() is not None and not self._closing:
                        self._fail(rank, proc)
                        return
                hung = self._hung_step()
                if hung is not None and not self._closing:
                    self._declare_dead(*hung)
                    return
        finally:
            for fd in fds:
                os.close(fd)

    def _hung_step(self) -> tuple[str, int] | None:
        """``(message, rank)`` when a step has waited on a rank past the watchdog."""
        timeout = self.config.engine.execute_timeout
        if timeout is None:
            return None
        now = time.monotonic()
        with self._lock:
            late = [
                c
                for c in self._pending.values()
                if c.method in WATCHED_METHODS and now - c.started > timeout
            ]
        if not late:
            return None
        call = late[0]
        ranks = sorted(call.remaining) or list(range(self.world_size))
        stopped = [r for r in ranks if _is_stopped(self.procs[r].pid)]
        rank = (stopped or ranks)[0]
        pid = self.procs[rank].pid
        state = "is stopped (SIGSTOP)" if stopped else "did not answer"
        message = (
            f"rank {rank} (pid {pid}) {state}: {call.method} took longer than "
            f"{timeout:g} s (engine.execute_timeout); ranks still running it: {ranks}"
        )
        return message, rank

    def _fail(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        self._declare_dead(describe_exit(rank, proc.pid, proc.returncode), rank)

    def _declare_dead(self, message: str, rank: int) -> None:
        logger.error("%s", message)
        with self._lock:
            self._dead, self._dead_rank = message, rank
            pending, self._pending = self._pending, {}
        for call in pending.values():
            _settle(call.future, error=WorkerDiedError(message, rank))
        self._report_failure(message)

    # --- shutdown ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            with self._lock:
                self._pub.send(encode_call(CALL_SHUTDOWN, "shutdown", (), None, None))
        except zmq.ZMQError:
            pass
        # After a death the survivors may sit in a broken collective: do not wait long.
        _kill_all(self.procs, 5.0 if self._dead is None else 0.5)
        self._monitor_wake()
        with self._lock:
            pending, self._pending = self._pending, {}
        for call in pending.values():
            _settle(call.future, error=EngineShutdownError("the executor was shut down"))
        for thread in (self._response_thread, self._monitor_thread):
            thread.join(timeout=2.0)
        self._close_channels()

    def _close_channels(self) -> None:
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)
