"""EngineCoreProc: the engine core in its own process, behind ZeroMQ.

Two I/O threads keep sockets away from the loop: the input thread decodes messages onto
``input_queue``; the output thread encodes from ``output_queue``. The busy loop blocks
on the input queue only when it has no work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from enginecore import startup_log
from enginecore.config import EngineConfig
from enginecore.engine.core import EngineCore, StepResult
from enginecore.engine.exit_deadline import STOP_GRACE, arm_exit_deadline
from enginecore.engine.step_watchdog import StepWatchdog
from enginecore.engine.wire_auth import secure_client
from enginecore.errors import EngineDeadError, RankError
from enginecore.lora_request import LoRARequest
from enginecore.plugin_attribution import with_attribution
from enginecore.proc_title import set_process_title
from enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from enginecore.request import FinishReason
from enginecore.runtime_dirs import remove_dirs_of
from enginecore.serial import MsgpackDecoder, MsgpackEncoder, find_unpicklable

logger = logging.getLogger(__name__)

HANDSHAKE_READY = b"READY"
HANDSHAKE_FAILED = b"FAILED"
_STOP = object()
#: Seconds a process whose step hung gives its output thread to tell the frontends.
STEP_HUNG_EXIT = 2.0


class EngineCoreProc(EngineCore):
    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        engine_index: int = 0,
        curve_keys: dict[str, bytes] | None = None,
    ) -> None:
        self.engine_index = engine_index  # this replica's data-parallel rank
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._deferred: deque[tuple[EngineCoreRequestType, Any]] = deque()
        self._shutdown_requested = False
        self._draining_since: float | None = None
        self._watchdog: StepWatchdog | None = None  # from run_busy_loop on
        self.ctx = zmq.Context()
        # Several API servers (``--api-server-count``): one input and one output address
        # each, comma-separated; client i's outputs go to output address i.
        self.output_sockets = []
        for address in output_address.split(","):
            sock = self.ctx.socket(zmq.PUSH)
            secure_client(sock, curve_keys)
            sock.connect(address)
            self.output_sockets.append(sock)
        self.output_socket = self.output_sockets[0]
        self.input_socket = self.ctx.socket(zmq.PULL)
        secure_client(self.input_socket, curve_keys)
        for address in input_address.split(","):  # PULL fair-queues the clients
            self.input_socket.connect(address)
        # Pickled objects only on IPC sockets (an owner-only directory), never over TCP.
        self.allow_pickle = input_address.startswith("ipc://")
        super().__init__(config)
        self.send_plain_steps_as_columns()  # every client of the output sockets reads them
        self.executor.register_failure_callback(
            lambda message: self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, message))
        )

    # --- I/O threads ------------------------------------------------------------------------

    def start_io_threads(self) -> None:
        threading.Thread(target=self._input_thread, name="enginecore-input", daemon=True).start()
        self._output_thread = threading.Thread(
            target=self._output_thread_fn, name="enginecore-output", daemon=True
        )
        self._output_thread.start()

    def _input_thread(self) -> None:
        add_decoder = MsgpackDecoder(EngineCoreRequest)
        any_decoder = MsgpackDecoder(allow_pickle=self.allow_pickle)
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        while True:
            try:
                ready = poller.poll(1000)
            except zmq.ZMQError:
                return  # the socket closed at shutdown
            if not ready:
                continue
            try:
                frames = self.input_socket.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            tag, payload = bytes(frames[0].buffer), frames[1:]
            try:
                kind = EngineCoreRequestType(tag)
            except ValueError:  # a peer of another version, or garbage: never fatal
                logger.error("dropping a message with the unknown tag %r", tag)
                continue
            try:
                if kind is EngineCoreRequestType.ADD:
                    message = add_decoder.decode(payload)
                else:
                    message = any_decoder.decode(payload) if payload else None
            except Exception as exc:
                logger.error("dropping an undecodable %s message: %s", kind.name, exc)
                continue
            self.input_queue.put((kind, message))

    def _output_thread_fn(self) -> None:
        encoder = MsgpackEncoder(allow_pickle=self.allow_pickle)
        while True:
            entry = self.output_queue.get()
            if entry is _STOP:
                return
            client, item = entry if isinstance(entry, tuple) else (0, entry)
            item.engine_index = self.engine_index  # every output names its replica
            try:
                frames = encoder.encode(item)
            except TypeError as exc:  # a utility result this socket cannot carry
                if item.utility_output is None:
                    raise
                item.utility_output.result = None
                item.utility_output.failure_message = f"TypeError: {exc}"
                frames = encoder.encode(item)
            for sock in self._output_targets(client, item):
                sock.send_multipart(frames, copy=False)

    def _output_targets(self, client: int | None, item: EngineCoreOutputs) -> list[zmq.Socket[Any]]:
        """A client's own socket; every client's for the death sentinel and for
        ``client`` None (requests of any client, e.g. all aborted at once)."""
        sockets = self.output_sockets
        if item.engine_dead is not None or client is None:
            return sockets
        return [sockets[client] if 0 <= client < len(sockets) else sockets[0]]

    # --- the busy loop --------------------------------------------------------------------------

    def run_busy_loop(self) -> None:
        step = self.step_fn()
        limit = self.config.engine.execute_timeout
        self._watchdog = (
            StepWatchdog(limit, self._step_hung, self.plugins) if limit is not None else None
        )
        try:
            while True:
                self._process_input_queue()
                if self._shutdown_requested and self._finish_shutdown():
                    return
                with self._watched():
                    self._process_engine_step(step)
        finally:
            if self._watchdog is not None:
                self._watchdog.close()

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """Within the step watchdog: a step, or an added or aborted request (which run
        the policy's and the KV connector's code)."""
        watchdog = self._watchdog
        if watchdog is None:
            yield
            return
        watchdog.started()
        try:
            yield
        finally:
            watchdog.ended()

    def _step_hung(self, message: str) -> None:
        """A plugin holds the loop for good: tell the frontends why, then exit."""
        logger.error("%s", message)
        self.output_queue.put(EngineCoreOutputs(engine_dead=message).stamp())
        arm_exit_deadline(STEP_HUNG_EXIT, "a step hung")

    def _process_input_queue(self) -> None:
        while self._deferred:
            self._handle(*self._deferred.popleft())
        # Block only when there is nothing to do (an idle engine uses no CPU).
        while not self.has_work() and not self._shutdown_requested:
            self._handle(*self.input_queue.get())
        while True:
            try:
                self._handle(*self.input_queue.get_nowait())
            except queue.Empty:
                return

    def _process_engine_step(self, step: Callable[[], StepResult]) -> None:
        outputs, model_executed = step()
        for client, client_outputs in outputs.items():
            self.output_queue.put((client, client_outputs.stamp()))
        if not model_executed and not outputs and not self.batch_queue:
            # Requests exist but none can run (e.g. waiting for remote KV): yield briefly.
            time.sleep(0.001)

    def _apply_pending_aborts(self) -> None:
        """Aborts that arrived during the forward pass apply before update_from_output."""
        while True:
            try:
                kind, message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            if kind is EngineCoreRequestType.ABORT:
                self._drop_deferred_adds(message)
                self.abort_requests(message)
            else:
                self._deferred.append((kind, message))

    def _drop_deferred_adds(self, request_ids: list[str]) -> None:
        """An abort applied now also cancels its request's add if that waits in
        ``_deferred`` (both arrived during this forward pass): applied first, the abort
        would miss the request, which would then run to its end for nobody."""
        if not self._deferred:
            return
        gone = set(request_ids)
        kept = [
            (kind, message)
            for kind, message in self._deferred
            if not (kind is EngineCoreRequestType.ADD and message.request_id in gone)
        ]
        if len(kept) != len(self._deferred):
            self._deferred = deque(kept)

    def _handle(self, kind: EngineCoreRequestType, message: Any) -> None:
        if kind is EngineCoreRequestType.ADD:
            with self._watched():
                self._handle_add(message)
        elif kind is EngineCoreRequestType.ABORT:
            with self._watched():
                self.abort_requests(message)
        elif kind is EngineCoreRequestType.UTILITY:
            self._handle_utility(*message)
        elif kind is EngineCoreRequestType.EXECUTOR_FAILED:
            raise EngineDeadError(f"executor failed: {message}")
        elif kind is EngineCoreRequestType.WAKEUP and message == "shutdown":
            self._shutdown_requested = True

    def _handle_add(self, request: EngineCoreRequest) -> None:
        rejection = None
        if self._shutdown_requested:
            rejection = "the engine is shutting down and admits no new requests"
        else:
            rejection = self.admission_refusal()
        if rejection is None:
            try:
                self.add_request(request)
                return
            except Exception as exc:
                rejection = with_attribution(exc, f"{type(exc).__name__}: {exc}")
        self._send_finished(
            [request.request_id], FinishReason.ERROR, request.client_index, rejection
        )

    def _handle_utility(
        self, client_index: int, call_id: int, method: str, args: tuple[Any, ...]
    ) -> None:
        output = UtilityOutput(call_id=call_id)
        try:
            call = self.utilities().get(method)
            if call is None:
                raise ValueError(f"{method!r} is not a utility method of the engine core")
            broken = find_unpicklable(args)
            if broken is not None:
                raise ValueError(
                    f"an argument could not be unpickled in the engine process ({broken.error}). "
                    f"Functions are sent by reference to their module: define the function "
                    f"inside another function, or make its module importable by the engine."
                )
            result = call(*args)
            if isinstance(result, Future):  # answered when it resolves, off this loop
                result.add_done_callback(functools.partial(self._answer, client_index, output))
                return
            output.result = result
        except Exception as exc:
            output.failure_message = f"{type(exc).__name__}: {exc}"
            output.failure_engine_dead = isinstance(exc, EngineDeadError)
            if isinstance(exc, RankError):  # rebuilt as a RankError in the frontend
                output.failure_message = exc.detail
                output.failure_rank, output.failure_method = exc.rank, exc.method
        self.output_queue.put((client_index, EngineCoreOutputs(utility_output=output).stamp()))

    def _answer(self, client_index: int, output: UtilityOutput, result: Future[Any]) -> None:
        """The reply to a utility call whose answer came later (``add_lora``)."""
        exc = result.exception()
        if exc is not None:
            output.failure_message = f"{type(exc).__name__}: {exc}"
        else:
            output.result = result.result()
        self.output_queue.put((client_index, EngineCoreOutputs(utility_output=output).stamp()))

    def _send_finished(
        self,
        request_ids: list[str],
        reason: FinishReason,
        client_index: int | None = 0,
        error: str | None = None,
    ) -> None:
        outputs = [
            EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=reason, error=error)
            for rid in request_ids
        ]
        if outputs:
            self.output_queue.put((client_index, EngineCoreOutputs(outputs=outputs).stamp()))

    # --- pause / sleep ------------------------------------------------------------------------

    def utilities(self) -> dict[str, Callable[..., Any]]:
        return {
            **super().utilities(),
            "pause_scheduler": self.pause_scheduler,
            "resume_scheduler": self.resume_scheduler,
            "is_paused": self.is_paused,
            "add_lora": self.add_lora,
            "remove_lora": self.remove_lora,
        }

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> Future[bool]:
        """Read a LoRA adapter into the workers without a request (vLLM's ``add_lora``):
        answered once it is read, or with the read's error; the loop keeps stepping."""
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA is off: start the engine with enable_lora (--enable-lora)")
        lora_request = LoRARequest(lora_name, lora_int_id, lora_path)
        admission = getattr(self.scheduler, "lora_admission", None)
        if admission is None:  # a scheduler that lets the workers read on first use
            done: Future[bool] = Future()
            done.set_result(True)
            return done
        future: Future[bool] = admission.request_load(lora_request)
        return future

    def remove_lora(self, lora_int_id: int) -> Future[bool]:
        """Unload a LoRA adapter from every worker (vLLM's ``remove_lora``): requests
        already queued or running with it finish first; answered once the workers have
        freed its device slot and host copy."""
        if not self.config.lora.enable_lora:
            raise ValueError("LoRA is off: start the engine with enable_lora (--enable-lora)")
        admission = getattr(self.scheduler, "lora_admission", None)
        if admission is None:  # a scheduler that does not track adapters: nothing to wait on
            done: Future[bool] = Future()
            done.set_result(False)
            return done
        future: Future[bool] = admission.request_removal(lora_int_id)
        return future

    def pause_scheduler(self, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        if mode == "abort":
            self.emit_drained(self.drain_batch_queue())
            self._send_finished(self.abort_all_requests(), FinishReason.ABORT, None)
        self._paused = mode

    def resume_scheduler(self) -> None:
        self._paused = None

    def is_paused(self) -> bool:
        return self._paused is not None

    def emit_drained(self, drained: list[dict[int, EngineCoreOutputs]]) -> None:
        for outputs in drained:
            for client, client_outputs in outputs.items():
                self.output_queue.put((client, client_outputs.stamp()))

    # --- shutdown -------------------------------------------------------------------------------

    def _finish_shutdown(self) -> bool:
        """True once it is time to stop: at once (abort mode) or after draining."""
        timeout = self.config.engine.shutdown_timeout
        if timeout > 0:
            if self._draining_since is None:
                self._draining_since = time.monotonic()
                logger.info("draining in-flight requests for up to %.1f s", timeout)
            if self.scheduler.has_unfinished_requests() and (
                time.monotonic() - self._draining_since < timeout
            ):
                return False
        self.emit_drained(self.drain_batch_queue())
        self._send_finished(self.abort_all_requests(), FinishReason.ABORT, None)
        return True

    def close(self, reason: str) -> None:
        self.output_queue.put(_STOP)
        if getattr(self, "_output_thread", None) is not None:
            self._output_thread.join(timeout=5)
        try:
            self.scheduler.shutdown()
            self.executor.shutdown()
        finally:
            self.plugins.engine_stopped(reason)
            for sock in self.output_sockets:
                sock.close(linger=2000)
            self.input_socket.close(linger=0)
            self.ctx.term()


#: Seconds between checks that the frontend process is still there.
PARENT_POLL = 0.2


def _watch_parent(parent_pid: int, get_engine: Any) -> None:
    """Stop when the frontend is gone, from the first moment on: during start-up (imports,
    model load) by exiting at once, so no orphan keeps the model's memory; once running,
    through an orderly shutdown. The executor's workers watch this process the same way."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL)
    remove_dirs_of(parent_pid)  # its socket directory: nobody else is left to remove it
    engine = get_engine()
    if engine is None:
        logger.warning("the frontend exited during start-up: stopping")
        os._exit(1)
    engine._shutdown_requested = True
    engine.input_queue.put((EngineCoreRequestType.WAKEUP, "parent exited"))
    grace = engine.config.engine.shutdown_timeout + STOP_GRACE
    arm_exit_deadline(grace, "the frontend exited")


def run_engine_core(
    config_bytes: bytes,
    input_address: str,
    output_address: str,
    engine_index: int = 0,
    curve_keys: dict[str, bytes] | None = None,
) -> None:
    """Entry point of the engine-core process (or of a Ray actor's thread, for data
    parallelism on Ray: there signals stay with Ray and shutdown comes as a message, and
    ``curve_keys`` authenticate the TCP sockets to the frontend)."""
    logging.basicConfig(
        level=os.environ.get("ENGINECORE_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s %(levelname)s [engine {engine_index}] %(name)s: %(message)s",
    )
    startup_log.enable()
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    engine: EngineCoreProc | None = None
    ready = False
    threading.Thread(
        target=_watch_parent,
        args=(os.getppid(), lambda: engine if ready else None),
        name="enginecore-parent-watch",
        daemon=True,
    ).start()

    def on_signal(signum: int, _frame: Any) -> None:
        # A state change, not an exception: the loop finishes the step and shuts down.
        if engine is not None:
            engine._shutdown_requested = True
            engine.input_queue.put((EngineCoreRequestType.WAKEUP, "shutdown"))
            grace = engine.config.engine.shutdown_timeout + STOP_GRACE
            arm_exit_deadline(grace, f"signal {signal.Signals(signum).name} asked to stop")
        else:
            # Still starting (Ctrl-C reaches the whole process group): nothing to drain and
            # nothing to report; the frontend says what happened. Workers watch this process.
            os._exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        engine = EngineCoreProc(config, input_address, output_address, engine_index, curve_keys)
    except BaseException as exc:
        _send_startup_failure(output_address, exc, curve_keys)
        raise SystemExit(1) from None
    encoder = MsgpackEncoder()
    ready_frames = [HANDSHAKE_READY, *encoder.encode(engine.ready_response())]
    for sock in engine.output_sockets:  # every API server waits for its handshake
        sock.send_multipart(ready_frames)
    if threading.current_thread() is threading.main_thread():  # a process of its own
        set_process_title(f"EngineCore_DP{engine_index}")
    engine.start_io_threads()
    ready = True
    reason = "shutdown"
    try:
        engine.run_busy_loop()
    except BaseException as exc:
        reason = with_attribution(exc, f"{type(exc).__name__}: {exc}")
        logger.error("engine core died: %s\n%s", reason, traceback.format_exc())
        engine.output_queue.put(EngineCoreOutputs(engine_dead=reason).stamp())
    finally:
        engine.close(reason)


def _send_startup_failure(
    output_address: str, exc: BaseException, curve_keys: dict[str, bytes] | None = None
) -> None:
    text = with_attribution(exc, f"{type(exc).__name__}: {exc}")
    logger.error("engine core failed to start: %s\n%s", text, traceback.format_exc())
    ctx = zmq.Context()
    for address in output_address.split(","):  # every API server waits for its handshake
        sock = ctx.socket(zmq.PUSH)
        secure_client(sock, curve_keys)
        sock.connect(address)
        sock.send_multipart([HANDSHAKE_FAILED, text.encode()])
        sock.close(linger=5000)
    ctx.term()


def main() -> None:
    """``python -c 'from enginecore.engine.core_proc import main; main()' IN OUT [INDEX]``
    with the msgpack-encoded config on stdin (how the frontend starts the engine process;
    INDEX is the data-parallel rank, 0 without data parallelism)."""
    import sys

    engine_index = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    run_engine_core(sys.stdin.buffer.read(), sys.argv[1], sys.argv[2], engine_index)
