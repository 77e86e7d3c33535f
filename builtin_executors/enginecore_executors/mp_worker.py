"""The worker process of the ``mp`` executor: one rank, one process, spawned fresh.

Started as ``python -m enginecore_executors.mp_worker`` with a pickled bootstrap
record on stdin (never forked: a forked child would inherit the engine's threads, locks
and ZeroMQ context). It subscribes to the broadcast channel, builds the generic Worker
(which joins the TP/PP process group and loads its shard of the weights), reports READY
or the reason it failed, then serves calls in order until told to stop or its parent
disappears.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any

import zmq

from enginecore import startup_log
from enginecore.proc_title import set_process_title
from enginecore.runtime_dirs import remove_dirs_of
from enginecore_executors.rpc import (
    CALL_READY,
    CALL_SHUTDOWN,
    decode_call,
    encode_reply,
    load_call,
    method_name,
)

logger = logging.getLogger(__name__)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the executor's process is gone (no orphan keeps a device busy)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            # A killed engine cannot remove its directory (sockets, rendezvous file).
            remove_dirs_of(parent_pid)
            os._exit(1)


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text


def serve(boot: dict[str, Any]) -> None:
    import msgspec

    from enginecore.config import EngineConfig
    from enginecore.interfaces import WorkerSpec
    from enginecore.registry import import_ref

    rank: int = boot["rank"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(boot["broadcast_address"])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(boot["response_address"])

    worker: Any = None
    try:
        config = msgspec.msgpack.decode(boot["config"], type=EngineConfig)
        spec = msgspec.msgpack.decode(boot["worker_spec"], type=WorkerSpec)
        worker_cls = import_ref(spec.worker_ref)
        worker = worker_cls(
            config,
            spec,
            rank=rank,
            local_rank=boot["local_rank"],
            distributed_init_method=boot["init_method"],
        )
        worker.init_device()
        worker.load_model()
    except BaseException as exc:
        logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        push.send(encode_reply(CALL_READY, rank, False, _error_text(exc)))
        push.close(linger=5000)
        ctx.term()
        raise SystemExit(1) from None
    push.send(encode_reply(CALL_READY, rank, True, os.getpid()))
    # Titled once started, as the engine core is (ranks are pipeline-major).
    tp_size = config.parallel.tensor_parallel_size
    set_process_title(f"Worker_TP{rank % tp_size}_PP{rank // tp_size}")

    while True:
        call_id, method, payload, reply_rank = decode_call(sub.recv())
        if call_id == CALL_SHUTDOWN:
            break
        try:
            method, args, kwargs = load_call(method, payload)
            result = worker.resolve_method(method)(*args, **kwargs)
        except Exception as exc:
            logger.debug("rank %d raised in %s", rank, method_name(method), exc_info=True)
            push.send(encode_reply(call_id, rank, False, _error_text(exc)))
            continue
        if reply_rank is not None and reply_rank != rank:
            result = None  # the executor only needs to know this rank finished
        push.send(encode_reply(call_id, rank, True, result))

    try:
        shutdown = getattr(worker, "shutdown", None)
        if shutdown is not None:
            shutdown()
    except Exception:
        logger.exception("rank %d: error while shutting the worker down", rank)
    sub.close(linger=0)
    push.close(linger=1000)
    ctx.term()


def main() -> None:
    boot = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(
        level=os.environ.get("ENGINECORE_LOG_LEVEL", "WARNING").upper(),
        format=f"%(asctime)s %(levelname)s [rank {boot['rank']}] %(name)s: %(message)s",
    )
    startup_log.enable()
    threading.Thread(
        target=_watch_parent, args=(boot["parent_pid"],), name="parent-watch", daemon=True
    ).start()
    serve(boot)


if __name__ == "__main__":
    main()
