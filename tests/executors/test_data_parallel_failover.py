"""Failover of a dead data-parallel replica (``data_parallel_failover``), with SIGKILL.

Replica 1 is stopped (SIGSTOP: it takes requests and answers none), requests are sent,
and it is then SIGKILLed: its requests are in flight with no output. With ``error`` they
fail with an error naming the replica; with ``retry`` they are resubmitted once to
replica 0 and finish with the same greedy tokens as transformers. A request that has
already streamed tokens is never resubmitted (the client would see them twice): it fails
in both modes.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from enginecore import LLM, AsyncLLM, SamplingParams
from enginecore.errors import EngineDeadError
from tests.helpers.event_loop import LoopThread
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DP_ARGS = dict(data_parallel_size=2, dtype="float32", num_blocks_override=128, max_model_len=512)


def _kill_after_queueing(pid: int) -> threading.Timer:
    """Freeze the replica now, SIGKILL it a second later (after the requests went in)."""
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


@pytest.mark.parametrize("failover", ["error", "retry"])
def test_requests_of_a_killed_replica_fail_or_are_retried(tiny_llama, failover) -> None:
    prompts = mixed_prompts(3)[:4]
    llm = LLM(tiny_llama, data_parallel_failover=failover, **DP_ARGS)
    timer = None
    try:
        timer = _kill_after_queueing(llm.engine_client.engines[1].proc.pid)
        requests = [{"prompt_token_ids": p} for p in prompts]
        coordinator = llm.engine_client.coordinator
        if failover == "error":
            with pytest.raises(EngineDeadError, match="data-parallel replica 1 died"):
                llm.generate(requests, GREEDY)
            after = llm.generate(requests, GREEDY)  # replica 0 serves on alone
            assert coordinator.served[1] == 0 and coordinator.served[0] >= 4
        else:
            after = llm.generate(requests, GREEDY)
            assert coordinator.served == [4, 0], "every request finished on replica 0"
            assert llm.engine_client.retried == set(), "retries are forgotten once finished"
        assert list(coordinator.dead) == [1]
        for prompt, out in zip(prompts, after, strict=True):
            want = greedy_reference(tiny_llama, prompt, 8)
            assert_matches_reference(out.outputs[0].token_ids, want, f"{failover} survivor")
    finally:
        if timer is not None:
            timer.cancel()
        llm.shutdown()


async def _collect(llm: AsyncLLM, collector) -> list[int]:
    tokens = []
    async for out in llm.stream(collector):
        tokens += out.outputs[0].token_ids
    return tokens


def test_a_request_that_streamed_tokens_is_not_retried(tiny_llama) -> None:
    loop = LoopThread()

    async def make() -> AsyncLLM:
        return AsyncLLM(tiny_llama, stat_loggers=[], data_parallel_failover="retry", **DP_ARGS)

    llm = loop.run(make())
    try:
        prompt = mixed_prompts(8)[2]

        async def go():
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            streams = {
                name: llm.add_request(name, {"prompt_token_ids": prompt}, params)
                for name in ("a", "b")
            }
            for stream in streams.values():
                await stream.get()  # both have streamed their first token
            owners = {name: llm.engine_client.engine_of(name) for name in streams}
            assert sorted(owners.values()) == [0, 1], owners
            doomed = next(name for name, owner in owners.items() if owner == 1)
            survivor = next(name for name, owner in owners.items() if owner == 0)
            os.kill(llm.engine_client.engines[1].proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="data-parallel replica 1 died"):
                await _collect(llm, streams[doomed])
            return await _collect(llm, streams[survivor])

        rest = loop.run(go())
        assert rest, "the request on the live replica kept streaming"
        assert llm.engine_client.retried == set()
        assert llm.engine_client.coordinator.served == [1, 0]
    finally:
        llm.shutdown()
        loop.close()
