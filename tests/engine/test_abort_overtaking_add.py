"""An abort that arrives with its own request, while a step runs, still wins.

During a forward pass the engine process drains its input: aborts apply at once, adds
wait for the step's end. A client that hangs up right after its first event (a chat's
role chunk) sends the add and the abort back to back; both may land in the same forward
pass, and the abort must then cancel the deferred add, not be applied first to a request
the engine does not know yet (which then ran to its end for nobody). Counted in outputs:
requests added and aborted back to back, while a long request keeps the engine
stepping, produce no token at all.
"""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import zmq

from enginecore import SamplingParams, make_config
from enginecore.engine.core_proc import HANDSHAKE_READY
from enginecore.engine.mp_client import ENGINE_ENTRY
from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from enginecore.serial import MsgpackDecoder, MsgpackEncoder

PAIRS = 30


def _request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return EngineCoreRequest(
        request_id, [5, 6, 7, 8], params, arrival_time=time.time(), max_tokens=max_tokens
    )


def test_requests_aborted_right_after_they_are_added_generate_nothing(tiny_llama, tmp_path):
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/input")
    pull.bind(f"ipc://{tmp_path}/output")
    config = make_config(model=str(tiny_llama), dtype="float32", stat_loggers=[])
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_ENTRY, f"ipc://{tmp_path}/input", f"ipc://{tmp_path}/output"],
        stdin=subprocess.PIPE,
    )
    proc.stdin.write(msgspec.msgpack.encode(config))
    proc.stdin.close()
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def send(kind: EngineCoreRequestType, payload) -> None:
        push.send_multipart([kind.value, *encoder.encode(payload)])

    tokens: dict[str, int] = {}
    finished: set[str] = set()

    def read(timeout_ms: int) -> bool:
        if not pull.poll(timeout_ms):
            return False
        outputs = decoder.decode(pull.recv_multipart())
        for out in outputs.all_outputs():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
        return True

    try:
        assert pull.poll(240_000), "the engine did not answer the handshake"
        assert pull.recv_multipart()[0] == HANDSHAKE_READY
        # A long request keeps the engine in forward passes.
        send(EngineCoreRequestType.ADD, _request("long", 2_000))
        while tokens.get("long", 0) < 5:
            assert read(60_000), "the long request produced nothing"
        for i in range(PAIRS):
            send(EngineCoreRequestType.ADD, _request(f"gone-{i}", 100))
            send(EngineCoreRequestType.ABORT, [f"gone-{i}"])
            read(0)
            time.sleep(0.005)
        # Ten more steps: a deferred add that escaped its abort is in the batch by now.
        target = tokens["long"] + 10
        while tokens["long"] < target:
            assert read(60_000), "the long request stopped"
        leaked = {rid: n for rid, n in tokens.items() if rid.startswith("gone-") and n}
        assert not leaked, f"aborted requests ran on: {leaked}"

    finally:
        proc.terminate()
        proc.wait(30)
        push.close(0)
        pull.close(0)
        ctx.term()
