"""msgpack (msgspec) encoding for the frontend <-> engine-core sockets.

Tensors and ndarrays at or above a size threshold travel as separate ZeroMQ frames
(zero-copy: the frame is the array's own buffer); smaller ones are inlined. Objects
msgpack cannot express (a callable for ``collective_rpc`` from the trusted Python API, an
arbitrary utility result) are cloudpickled into an extension type, but only where both
ends say ``allow_pickle``: on IPC sockets in an owner-only (0700) directory. On TCP
sockets (data parallelism on Ray) the wire carries msgpack types only: the encoder
refuses to pickle and the decoder never unpickles, so whoever can connect to such a
socket cannot make the other side run code.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import cloudpickle
import msgspec
import numpy as np

# Extension type codes (wire ABI).
EXT_NDARRAY_INLINE = 1
EXT_NDARRAY_FRAME = 2
EXT_TENSOR_INLINE = 3
EXT_TENSOR_FRAME = 4
EXT_PICKLE = 5

DEFAULT_FRAME_THRESHOLD = 256  # bytes

Frames = list[Any]  # bytes / memoryview / zmq.Frame


def _torch() -> ModuleType:
    import torch

    return torch


class Unpicklable:
    """Stands in for an object that could not be unpickled on this side (for example a
    function whose module the receiving process cannot import)."""

    def __init__(self, error: str) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"Unpicklable({self.error!r})"


def find_unpicklable(value: Any, depth: int = 3) -> Unpicklable | None:
    if isinstance(value, Unpicklable):
        return value
    if depth and isinstance(value, list | tuple):
        return next(filter(None, (find_unpicklable(v, depth - 1) for v in value)), None)
    if depth and isinstance(value, dict):
        return next(filter(None, (find_unpicklable(v, depth - 1) for v in value.values())), None)
    return None


class MsgpackEncoder:
    """Encodes one message into ``[main_frame, *array_frames]``; reuses its main buffer."""

    def __init__(
        self, frame_threshold: int = DEFAULT_FRAME_THRESHOLD, *, allow_pickle: bool = False
    ) -> None:
        self.frame_threshold = frame_threshold
        self.allow_pickle = allow_pickle
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffer = bytearray()
        self._aux: list[Any] | None = None

    def encode(self, obj: Any) -> Frames:
        self._aux = []
        try:
            self._encoder.encode_into(obj, self._buffer)
            # The main frame is copied once by zmq; the buffer is reused next time.
            return [bytes(self._buffer), *self._aux]
        finally:
            self._aux = None

    def _array_ext(self, arr: np.ndarray, inline_code: int, frame_code: int) -> msgspec.msgpack.Ext:
        arr = np.ascontiguousarray(arr)
        meta = (arr.dtype.str, arr.shape)
        if arr.nbytes >= self.frame_threshold and self._aux is not None:
            self._aux.append(arr.data.cast("B"))
            index = len(self._aux)  # frame index in the multipart message
            return msgspec.msgpack.Ext(frame_code, msgspec.msgpack.encode((*meta, index)))
        return msgspec.msgpack.Ext(inline_code, msgspec.msgpack.encode((*meta, arr.tobytes())))

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            return self._array_ext(obj, EXT_NDARRAY_INLINE, EXT_NDARRAY_FRAME)
        torch = _torch()
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu()
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the bits
                arr = tensor.view(torch.int16).numpy()
                ext = self._array_ext(arr, EXT_TENSOR_INLINE, EXT_TENSOR_FRAME)
                return msgspec.msgpack.Ext(ext.code, msgspec.msgpack.encode(("bf16", ext.data)))
            ext = self._array_ext(tensor.numpy(), EXT_TENSOR_INLINE, EXT_TENSOR_FRAME)
            return msgspec.msgpack.Ext(ext.code, msgspec.msgpack.encode(("", ext.data)))
        if not self.allow_pickle:
            raise TypeError(
                f"a {type(obj).__name__} cannot be sent on this socket: it carries msgpack "
                "types only (pickled objects travel only on owner-only IPC sockets)"
            )
        return msgspec.msgpack.Ext(EXT_PICKLE, cloudpickle.dumps(obj, protocol=5))


class MsgpackDecoder:
    """Decodes ``[main_frame, *array_frames]`` into ``type_`` (or plain data)."""

    def __init__(self, type_: Any = Any, *, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        self._frames: Sequence[Any] = ()

    def decode(self, frames: Sequence[Any]) -> Any:
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._frames = ()

    def _array(self, data: bytes | memoryview, framed: bool) -> np.ndarray:
        dtype, shape, payload = msgspec.msgpack.decode(data)
        buf = _buffer(self._frames[payload]) if framed else payload
        return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code in (EXT_NDARRAY_INLINE, EXT_NDARRAY_FRAME):
            return self._array(data, code == EXT_NDARRAY_FRAME)
        if code in (EXT_TENSOR_INLINE, EXT_TENSOR_FRAME):
            torch = _torch()
            kind, inner = msgspec.msgpack.decode(data)
            arr = self._array(inner, code == EXT_TENSOR_FRAME)
            tensor = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
            return tensor.view(torch.bfloat16) if kind == "bf16" else tensor
        if code == EXT_PICKLE:
            if not self.allow_pickle:  # never unpickle what arrived on an open socket
                return Unpicklable("pickled objects are refused on this socket")
            try:
                return pickle.loads(data)
            except Exception as exc:  # keep the rest of the message usable
                return Unpicklable(f"{type(exc).__name__}: {exc}")
        raise ValueError(f"unknown msgpack extension type {code}")


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame
