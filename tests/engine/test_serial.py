"""Wire encoding: small outputs stay small, arrays travel as separate frames, structs round-trip."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from enginecore.params import SamplingParams
from enginecore.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
)
from enginecore.request import FinishReason
from enginecore.serial import MsgpackDecoder, MsgpackEncoder, Unpicklable


def test_plain_decode_output_is_a_few_dozen_bytes() -> None:
    outputs = EngineCoreOutputs(plain_req_ids=["req-17"], plain_token_ids=[4242])
    outputs.timestamp = 12345.678
    frames = MsgpackEncoder().encode(outputs)
    assert len(frames) == 1
    assert len(frames[0]) < 40, len(frames[0])


def test_plain_rows_as_columns_are_smaller_and_unfold_to_the_objects() -> None:
    ids = [f"req-{i}" for i in range(256)]
    tokens = [1000 + i for i in range(256)]
    columns = EngineCoreOutputs(plain_req_ids=ids, plain_token_ids=tokens)
    objects = EngineCoreOutputs(outputs=columns.plain_outputs())
    assert objects.outputs == [EngineCoreOutput(i, [t]) for i, t in zip(ids, tokens, strict=True)]
    column_bytes = len(MsgpackEncoder().encode(columns)[0])
    object_bytes = len(MsgpackEncoder().encode(objects)[0])
    assert column_bytes * 2 < object_bytes, (column_bytes, object_bytes)
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(columns))
    assert decoded.all_outputs() == objects.outputs
    # A row the engine must amend (a runner error) moves to the objects, the rest stay.
    decoded.unfold_plain({"req-3"})
    assert [o.request_id for o in decoded.outputs] == ["req-3"]
    assert len(decoded.plain_req_ids) == 255 and "req-3" not in decoded.plain_req_ids


def test_request_round_trip_keeps_every_field() -> None:
    request = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.5, stop=["\n"], max_tokens=9, seed=3),
        arrival_time=1.5,
        eos_token_id=2,
        priority=-1,
    )
    frames = MsgpackEncoder().encode(request)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(frames)
    assert decoded == request
    assert decoded.sampling_params.stop == ["\n"]


def test_finish_reason_is_one_small_int() -> None:
    out = EngineCoreOutput(request_id="a", new_token_ids=[], finish_reason=FinishReason.LENGTH)
    decoded = MsgpackDecoder(EngineCoreOutput).decode(MsgpackEncoder().encode(out))
    assert decoded.finish_reason is FinishReason.LENGTH
    assert str(decoded.finish_reason) == "length"


def test_large_arrays_travel_as_separate_frames_small_ones_inline() -> None:
    encoder = MsgpackEncoder(frame_threshold=256)
    big = np.arange(1000, dtype=np.int32)
    small = np.arange(4, dtype=np.float32)
    tensor = torch.arange(300, dtype=torch.float32).reshape(10, 30)
    bf16 = torch.randn(200, dtype=torch.bfloat16)
    frames = encoder.encode({"big": big, "small": small, "t": tensor, "bf": bf16})
    assert len(frames) == 4  # main + big + tensor + bf16 (small stayed inline)
    decoded = MsgpackDecoder().decode(frames)
    assert np.array_equal(decoded["big"], big)
    assert np.array_equal(decoded["small"], small)
    assert torch.equal(decoded["t"], tensor)
    assert decoded["bf"].dtype == torch.bfloat16 and torch.equal(decoded["bf"], bf16)


def test_callables_and_arbitrary_results_are_pickled() -> None:
    def double(worker, x):
        return 2 * x

    encoder = MsgpackEncoder(allow_pickle=True)
    frames = encoder.encode((0, 7, "collective_rpc", (double, None, (21,), None)))
    _, call_id, method, args = MsgpackDecoder(allow_pickle=True).decode(frames)
    assert call_id == 7 and method == "collective_rpc"
    assert args[0](None, *args[2]) == 42
    result = {"ratio": Fraction(1, 3)}  # not a msgpack type: pickled
    out = EngineCoreOutputs(utility_output=UtilityOutput(call_id=3, result=result))
    decoded = MsgpackDecoder(EngineCoreOutputs, allow_pickle=True).decode(encoder.encode(out))
    assert decoded.utility_output.result == result


class _TouchOnUnpickle:
    """Unpickling it creates a file: what an attacker's payload would do."""

    def __init__(self, path) -> None:
        self.path = path

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_by_default_nothing_is_pickled_or_unpickled(tmp_path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(TypeError, match="msgpack types only"):
        MsgpackEncoder().encode({"x": Fraction(1, 3)})
    frames = MsgpackEncoder(allow_pickle=True).encode([_TouchOnUnpickle(marker)])
    (decoded,) = MsgpackDecoder().decode(frames)
    assert isinstance(decoded, Unpicklable) and "refused" in decoded.error
    assert not marker.exists()


def test_encoder_buffer_is_reused_without_corrupting_earlier_messages() -> None:
    encoder = MsgpackEncoder()
    first = encoder.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1, 2, 3])]))
    second = encoder.encode(EngineCoreOutputs(outputs=[EngineCoreOutput("b", [9])]))
    decoder = MsgpackDecoder(EngineCoreOutputs)
    assert decoder.decode(first).outputs[0].new_token_ids == [1, 2, 3]
    assert decoder.decode(second).outputs[0].request_id == "b"


def test_request_type_tags_are_single_bytes() -> None:
    assert {len(t.value) for t in EngineCoreRequestType} == {1}
    assert EngineCoreRequestType(b"\x00") is EngineCoreRequestType.ADD
