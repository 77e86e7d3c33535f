"""Input staging against an asynchronous device, driven on CPU by an instrumented stream.

A GPU runs a non-blocking host-to-device copy later, when its stream reaches it, and
reads the host buffer then. :class:`InstrumentedStream` models that on CPU: every
``copy_(..., non_blocking=True)`` is queued instead of run, queued work runs in order
when an event recorded behind it is waited on (or at the end of the test), and the
attention kernels' reads of the metadata are queued the same way. A backend that refills
one host buffer every step without waiting for the copy that read it hands the kernels of
an earlier step the next step's slot mapping: K/V written to the wrong slots.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from enginecore import staging
from enginecore.interfaces import AttentionSpec
from enginecore.layers.attention import AttentionBatch
from enginecore_attention.triton_backend import TritonAttentionBackend


class InstrumentedEvent:
    def __init__(self, stream: InstrumentedStream) -> None:
        self.stream = stream
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.run(until=self)


class InstrumentedStream(TorchFunctionMode):
    """A device queue: non-blocking copies and recorded events run in order, later."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[Callable[[], None] | InstrumentedEvent] = []
        self.waits = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
        if func is torch.Tensor.copy_ and non_blocking:
            dst, src = args[0], args[1]
            self.queue.append(lambda: dst.copy_(src))
            return dst
        return func(*args, **kwargs)

    def record(self) -> InstrumentedEvent:
        event = InstrumentedEvent(self)
        self.queue.append(event)
        return event

    def enqueue(self, work: Callable[[], None]) -> None:
        self.queue.append(work)

    def run(self, until: InstrumentedEvent | None = None) -> None:
        while self.queue:
            item = self.queue.pop(0)
            if isinstance(item, InstrumentedEvent):
                item.done = True
                if item is until:
                    return
            else:
                item()


def _batch(step: int) -> AttentionBatch:
    """Step ``step`` of a long prompt's chunked prefill: 4 tokens per chunk, its own
    blocks, so every step's slot mapping differs."""
    q = np.array([4], dtype=np.int64)
    ctx = np.array([4 * step], dtype=np.int64)
    table = np.array([[10, 11, 12, 13]], dtype=np.int64)
    positions = np.arange(4 * step, 4 * step + 4)
    slots = table[0, positions // 4] * 4 + positions % 4
    return AttentionBatch(
        req_ids=["long"],
        query_lens=q,
        context_lens=ctx,
        block_table=table,
        slot_mapping=slots,
        num_decodes=0,
    )


def test_metadata_of_steps_without_a_sync_reaches_the_kernels_intact(monkeypatch):
    stream = InstrumentedStream()
    monkeypatch.setattr(staging.DeviceEvents, "record", lambda self: stream.record())
    spec = AttentionSpec(1, 2, 1, 16, torch.float32, torch.device("cpu"), 4, 64, 4, 64)
    backend = TritonAttentionBackend(spec)
    for value in vars(backend).values():
        for buf in value if isinstance(value, list) else [value]:
            if getattr(buf, "host", False) is None:
                # A CUDA device stages through a host buffer: give the CPU one too.
                buf.host = torch.zeros_like(buf.device_buf)
    seen: list[tuple[list[int], list[int], list[int]]] = []
    with stream:
        for step in range(3):  # no step syncs: each is a chunk that samples nothing
            meta = backend.build_metadata(_batch(step))
            stream.enqueue(
                lambda m=meta: seen.append(
                    (m.slot_mapping.tolist(), m.seq_lens.tolist(), m.query_start_loc.tolist())
                )
            )
        stream.run()
    expected = [(_batch(s).slot_mapping.tolist(), [4 * s + 4], [0, 4]) for s in range(3)]
    assert seen == expected
    # Two host buffers: only the third step waits, for the first step's copy.
    assert stream.waits > 0


def test_staging_buffer_waits_only_when_its_host_buffer_is_still_being_read():
    stream = InstrumentedStream()
    events = staging.DeviceEvents(torch.device("cpu"))
    events.record = stream.record  # type: ignore[method-assign]
    buf = staging.StagingBuffer((8,), torch.int64, torch.device("cpu"), events)
    seen: list[list[int]] = []
    with stream:
        for step in range(5):
            if step < 2:
                assert buf.ready()
            else:
                assert not buf.ready()  # the copy of step - 2 is still queued
            view = buf.fill(np.arange(step, step + 3))
            stream.enqueue(lambda v=view: seen.append(v.tolist()))
        stream.run()
    assert seen == [list(range(s, s + 3)) for s in range(5)]
    assert stream.waits == 3
