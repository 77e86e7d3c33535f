"""Clients that run the engine core in its own process and talk to it over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import shutil
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from enginecore.config import EngineConfig
from enginecore.distributed import replica_env
from enginecore.engine.attached_engine import RemoteEngineProcess, attach_link
from enginecore.engine.client import EngineCoreClient
from enginecore.engine.core_proc import HANDSHAKE_FAILED, HANDSHAKE_READY
from enginecore.engine.send_queue import SendQueue
from enginecore.errors import EngineCoreError, EngineDeadError, RankError
from enginecore.openmp import child_env
from enginecore.protocol import (
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineCoreRequestType,
)
from enginecore.runtime_dirs import make_runtime_dir, remove_dirs_of
from enginecore.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 200  # how often a silent output socket triggers a process check


class UtilityError(EngineCoreError):
    """A utility call raised inside the engine core (the engine keeps running)."""


class RemoteRankError(UtilityError, RankError):
    """A worker RPC raised on one rank: a :class:`RankError` (with ``.rank``) in every
    process mode, and a :class:`UtilityError` like any failed utility call."""


ENGINE_ENTRY = "from enginecore.engine.core_proc import main; main()"


def _dead_message(proc: subprocess.Popen[bytes]) -> str:
    return (
        f"the engine core process (pid {proc.pid}) died unexpectedly with exit code {proc.poll()}"
    )


def _cleanup(
    proc: subprocess.Popen[bytes],
    ctx: zmq.Context[Any],
    sockets: list[zmq.Socket[Any]],
    tmpdir: str,
) -> None:
    """Runs at shutdown, garbage collection or interpreter exit: no zombie is left."""
    _cleanup_engine(proc, sockets, tmpdir)
    ctx.term()


def _cleanup_engine(
    proc: subprocess.Popen[bytes], sockets: list[zmq.Socket[Any]], tmpdir: str
) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    for sock in sockets:
        sock.close(linger=0)
    _remove_files(proc, tmpdir)


def _remove_files(proc: subprocess.Popen[bytes], tmpdir: str) -> None:
    """Remove this frontend's socket directory and what the exited engine left behind
    (its executor's directory, when it was killed before it could remove it)."""
    shutil.rmtree(tmpdir, ignore_errors=True)
    remove_dirs_of(proc.pid)


class _EngineProcess:
    """Starts the engine process on private IPC sockets and performs the handshake.

    The process is a fresh interpreter (not a multiprocessing spawn), so user scripts
    need no ``if __name__ == "__main__"`` guard and nothing of the caller is re-imported.
    """

    client_index = 0  # the engine's only client

    def __init__(self, config: EngineConfig, ctx: zmq.Context[Any], engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.tmpdir = make_runtime_dir()  # mode 0700
        input_address = f"ipc://{self.tmpdir}/input"
        output_address = f"ipc://{self.tmpdir}/output"
        self.input_socket = ctx.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        # In a process group of its own: a terminal's Ctrl-C goes to the frontend alone,
        # which stops the engine (an interpreter still starting would die of it with a
        # traceback). The engine exits on its own when the frontend is gone. A local
        # data-parallel replica learns its index: its ranks take their own devices. Its
        # OpenMP threads sleep when idle (enginecore.openmp) unless the user chose.
        env = {**child_env(), **replica_env(config.parallel, engine_index)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE_ENTRY, input_address, output_address, str(engine_index)],
            stdin=subprocess.PIPE,
            process_group=0,
            env=env,
        )
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.write(msgspec.msgpack.encode(config))
        self.proc.stdin.close()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def exit_text(self) -> str:
        """How the engine ended, for error messages."""
        return f"the engine core process exited with code {self.proc.returncode}"

    def handshake(self, timeout: float) -> EngineCoreReadyResponse:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        waited = 0.0
        while True:
            if poller.poll(LIVENESS_POLL_MS):
                break
            waited += LIVENESS_POLL_MS / 1000
            if not self.is_alive():
                raise EngineDeadError(self.early_exit_text())
            if waited > timeout:
                raise EngineCoreError(f"the engine core was not ready within {timeout:.0f} s")
        frames = self.output_socket.recv_multipart(flags=zmq.NOBLOCK)
        if isinstance(frames, asyncio.Future | Future):  # zmq.asyncio socket
            frames = frames.result()
        if bytes(frames[0]) == HANDSHAKE_FAILED:
            self.wait_exit(10)
            raise EngineCoreError(f"the engine core failed to start: {bytes(frames[1]).decode()}")
        if bytes(frames[0]) != HANDSHAKE_READY:
            raise EngineCoreError("unexpected first message from the engine core")
        ready: EngineCoreReadyResponse = MsgpackDecoder(EngineCoreReadyResponse).decode(frames[1:])
        return ready

    def early_exit_text(self) -> str:
        """Why the engine is gone before its handshake."""
        return _describe_early_exit(self.proc.returncode)

    def wait_exit(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)

    def stop(self) -> None:
        """Ask the engine to stop (SIGTERM: it finishes the step and shuts down)."""
        if self.proc.poll() is None:
            self.proc.terminate()

    def close(self) -> None:
        """Wait for the engine to exit (killing it if it lingers) and free its sockets."""
        _cleanup_engine(self.proc, [self.input_socket, self.output_socket], self.tmpdir)

    def remove_files(self) -> None:
        """After the engine died: nothing will use the socket files any more."""
        _remove_files(self.proc, self.tmpdir)


class _AttachedEngine(_EngineProcess):
    """An engine core the launcher started for several API servers: this client binds
    its own address pair and handshakes as usual, but never stops the engine."""

    def __init__(self, link: dict[str, Any], ctx: zmq.Context[Any]) -> None:
        self.engine_index = 0
        self.client_index = int(link["client_index"])
        self.tmpdir = make_runtime_dir()  # nothing of the launcher's is removed with it
        self.input_socket = ctx.socket(zmq.PUSH)
        self.input_socket.bind(link["input"])
        self.output_socket = ctx.socket(zmq.PULL)
        self.output_socket.bind(link["output"])
        remote: Any = RemoteEngineProcess(int(link["engine_pid"]))
        self.proc = remote


class _MPClientBase(EngineCoreClient):
    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context[Any],
        while_starting: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.ctx = ctx
        # IPC sockets in an owner-only directory: pickled callables may cross.
        self.encoder = MsgpackEncoder(allow_pickle=True)
        self.decoder = MsgpackDecoder(EngineCoreOutputs, allow_pickle=True)
        link = attach_link()
        self.engine = _EngineProcess(config, ctx) if link is None else _AttachedEngine(link, ctx)
        self.client_index = self.engine.client_index
        self.proc = self.engine.proc
        self._finalizer = weakref.finalize(
            self,
            _cleanup,
            self.proc,
            ctx,
            [self.engine.input_socket, self.engine.output_socket],
            self.engine.tmpdir,
        )
        try:
            if while_starting is not None:
                while_starting()  # the engine process boots meanwhile
            self.ready = self.engine.handshake(config.engine.ready_timeout)
        except BaseException:
            self._finalizer()
            raise
        self.input_socket = self.engine.input_socket
        self.output_socket = self.engine.output_socket
        self._call_ids = itertools.count(1)
        self.dead_error: EngineDeadError | None = None
        self.sends = SendQueue()

    def pending_sends(self) -> int:
        return self.sends.pending

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if not isinstance(self.input_socket, zmq.asyncio.Socket):
            # A PUSH socket blocks while no engine is connected to it, for good once the
            # engine is dead: wait until it can take the message, checking the engine.
            while not self.input_socket.poll(LIVENESS_POLL_MS, zmq.POLLOUT):
                if self.dead_error is not None:
                    raise self.dead_error
                if self.proc.poll() is not None:
                    raise self._dead(_dead_message(self.proc))
        self.sends.track(
            self.input_socket.send_multipart(
                [kind.value, *self.encoder.encode(payload)], copy=False
            )
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index  # the engine sends its outputs back here
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def _dead(self, message: str) -> EngineDeadError:
        if self.dead_error is None:
            self.dead_error = EngineDeadError(message)
        return self.dead_error

    def shutdown(self) -> None:
        self._finalizer()


class SyncMPClient(_MPClientBase):
    """Used by ``LLM``: a reader thread routes outputs and utility results, and watches
    the engine process so a death is noticed within a bounded time."""

    def __init__(
        self, config: EngineConfig, while_starting: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config, zmq.Context(), while_starting)
        self.outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        self._utility_futures: dict[int, Future[Any]] = {}
        self._stop = threading.Event()
        # A socket is not thread-safe: ``LLM.remove_lora`` may send from another thread
        # while ``generate`` sends aborts.
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_outputs, daemon=True)
        self._reader.start()

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        with self._send_lock:
            super()._send(kind, payload)

    def _read_outputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = poller.poll(LIVENESS_POLL_MS)
            except zmq.ZMQError:
                return
            if not ready:
                if self.proc.poll() is not None and not self._stop.is_set():
                    self._fail(self._dead(_dead_message(self.proc)))
                    self.engine.remove_files()
                    return
                continue
            try:
                frames = self.output_socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            outputs = self.decoder.decode(frames)
            if outputs.utility_output is not None:
                future = self._utility_futures.pop(outputs.utility_output.call_id, None)
                if future is not None:
                    _resolve(future, outputs.utility_output)
                continue
            if outputs.engine_dead is not None:
                self._fail(self._dead(f"the engine core died: {outputs.engine_dead}"))
                self.engine.remove_files()
                return
            self.outputs.put(outputs)

    def _fail(self, error: EngineDeadError) -> None:
        self.outputs.put(error)
        for future in self._utility_futures.values():
            future.set_exception(error)
        self._utility_futures.clear()

    def get_output(self) -> EngineCoreOutputs:
        return take_output(self.outputs)

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        future: Future[Any] = Future()
        self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (self.client_index, call_id, method, args))
        return future.result()

    def shutdown(self) -> None:
        self._stop.set()
        super().shutdown()


class AsyncMPClient(_MPClientBase):
    """Used by ``AsyncLLM``: an asyncio task routes outputs and utility results."""

    def __init__(
        self, config: EngineConfig, while_starting: Callable[[], None] | None = None
    ) -> None:
        super().__init__(config, zmq.asyncio.Context(), while_starting)
        self.outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] | None = None
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[Any] | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self.outputs = asyncio.Queue()
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())

    async def _read_outputs(self) -> None:
        while True:
            ready = await self.output_socket.poll(LIVENESS_POLL_MS)
            if not ready:
                if self.proc.poll() is not None:
                    self._fail(self._dead(_dead_message(self.proc)))
                    self.engine.remove_files()
                    return
                continue
            frames = await self.output_socket.recv_multipart(copy=False)
            outputs = self.decoder.decode(frames)
            if outputs.utility_output is not None:
                future = self._utility_futures.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    _resolve(future, outputs.utility_output)
                continue
            if outputs.engine_dead is not None:
                self._fail(self._dead(f"the engine core died: {outputs.engine_dead}"))
                self.engine.remove_files()
                return
            assert self.outputs is not None  # made by _ensure_reader, which started this task
            self.outputs.put_nowait(outputs)

    def _fail(self, error: EngineDeadError) -> None:
        assert self.outputs is not None  # made by _ensure_reader, which started the reader
        self.outputs.put_nowait(error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
        self._utility_futures.clear()

    def get_output(self) -> EngineCoreOutputs:
        raise TypeError("AsyncMPClient: use 'await get_output_async()'")

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self.outputs is not None  # made by _ensure_reader
        return await take_output_async(self.outputs)

    def call_utility(self, method: str, *args: Any) -> Any:
        raise TypeError("AsyncMPClient: use 'await call_utility_async(...)'")

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_reader()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        self._send(EngineCoreRequestType.UTILITY, (self.client_index, call_id, method, args))
        return await future

    def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        super().shutdown()


def _resolve(future: Any, utility_output: Any) -> None:
    if utility_output.failure_rank is not None:
        future.set_exception(
            RemoteRankError(
                utility_output.failure_rank,
                utility_output.failure_method or "?",
                utility_output.failure_message or "",
            )
        )
    elif utility_output.failure_engine_dead:  # a worker died: the engine goes down too
        future.set_exception(EngineDeadError(utility_output.failure_message or "engine died"))
    elif utility_output.failure_message is not None:
        future.set_exception(UtilityError(utility_output.failure_message))
    else:
        future.set_result(utility_output.result)


def take_output(outputs: queue.Queue[EngineCoreOutputs | EngineDeadError]) -> EngineCoreOutputs:
    """The next output; a dead-engine error stays queued so every later call raises it."""
    item = outputs.get()
    if isinstance(item, EngineDeadError):
        outputs.put(item)
        raise item
    return item


async def take_output_async(
    outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError],
) -> EngineCoreOutputs:
    """:func:`take_output` for an asyncio queue."""
    item = await outputs.get()
    if isinstance(item, EngineDeadError):
        outputs.put_nowait(item)
        raise item
    return item


def _describe_early_exit(code: int | None) -> str:
    """Why the engine process is gone before its handshake; a crash leaves no message."""
    text = f"the engine core process exited with code {code} before it was ready"
    if code is not None and code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"{text}: it was killed by {name} (out of memory, or stopped from outside) "
            "before it could report an error"
        )
    return (
        f"{text} without reporting an error (a crash in native code or an import-time "
        "exit); run with multiprocessing=False to get the error in this process"
    )
