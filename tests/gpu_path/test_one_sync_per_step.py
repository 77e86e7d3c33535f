"""A step reads the device back once: the sampled ids (and logprobs) in one copy.

On a GPU every read of a device value on the host (``tolist``, ``item``, ``bool``,
``int`` of a tensor, ``.cpu()``, ``.numpy()``) waits for all queued work, and each one
between the forward and the step's outputs leaves the GPU idle. On CPU the same reads
are counted here: a torch function mode counts them, and the runner's device events are
replaced by ones that count their waits. A decode step over a batch that uses every
sampling feature (top-k, top-p, min-p, penalties, logprobs, a seed) must count exactly
one: the wait on the step's device-to-host copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from enginecore import SamplingParams
from tests.helpers.model_runner import PROMPTS, driver_for, make_runner

_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}


class SyncCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class CountingEvent:
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.counter.reads.append("event.synchronize")


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=8),
    SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_tokens=8),
    SamplingParams(
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logprobs=2,
        max_tokens=8,
    ),
]


def test_decode_steps_read_the_device_once(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs)
    runner.sampler.host_reads_free = False  # the sampler's path on a GPU
    counter = SyncCounter()
    events = getattr(runner, "events", None)  # the runner's seam to device events
    if events is not None:
        events.record = lambda: CountingEvent(counter)
    driver = driver_for(runner, budget=256)
    for i, params in enumerate(PARAMS):
        driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=params)
    driver.step()  # the prompts
    per_step = []
    for _ in range(3):
        counter.reads.clear()
        with counter:
            out = driver.step()
        assert all(len(t) == 1 for t in out.sampled_token_ids)
        per_step.append(list(counter.reads))
    assert per_step == [["event.synchronize"]] * 3


def test_listed_logprob_token_ids_ride_the_same_copy(tiny_llama, model_refs):
    """vLLM's ``logprob_token_ids`` beside top-k rows: still one read per step, and each
    listed row reports exactly its ids."""
    runner = make_runner(tiny_llama, model_refs)
    runner.sampler.host_reads_free = False
    counter = SyncCounter()
    events = getattr(runner, "events", None)
    if events is not None:
        events.record = lambda: CountingEvent(counter)
    driver = driver_for(runner, budget=256)
    listed = [5, 1, 40]
    params = [*PARAMS, SamplingParams(temperature=0.0, logprob_token_ids=listed, max_tokens=8)]
    for i, p in enumerate(params):
        driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=p)
    driver.step()
    for _ in range(2):
        counter.reads.clear()
        with counter:
            out = driver.step()
        assert counter.reads == ["event.synchronize"]
        assert out.logprobs is not None
        row = out.req_id_to_index["r4"]
        ids = out.logprobs.logprob_token_ids[row]
        assert ids == [out.sampled_token_ids[row][0], *listed]
        assert len(out.logprobs.logprob_token_ids[out.req_id_to_index["r3"]]) == 3
