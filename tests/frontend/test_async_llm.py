"""AsyncLLM on a real engine process (tiny random Llama), driven from one event loop.

The event loop runs in a background thread for the whole module, so one engine serves
every test (an AsyncMPClient is bound to the loop that first used it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

import enginecore
from enginecore import AsyncLLM, SamplingParams
from enginecore.engine import async_llm as async_llm_module
from enginecore.engine.collector import RequestOutputCollector
from enginecore.engine.output import CompletionOutput, OutputKind, RequestOutput
from enginecore.errors import EngineDeadError, InvalidRequestError
from enginecore.plugins import make_plugin_manager
from tests.helpers.event_loop import LoopThread, RecordingLogger

ENGINE_ARGS = dict(num_blocks_override=128, max_model_len=512, stat_loggers=["logging"])


class FinishedObserver:
    def __init__(self) -> None:
        self.finished: list = []

    @enginecore.hookimpl
    def request_finished(self, request_stats) -> None:
        self.finished.append(request_stats)


@pytest.fixture(scope="module")
def loop():
    runner = LoopThread()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_llama):
    observer = FinishedObserver()
    host = make_plugin_manager()
    host.register_object(observer, "finished-observer")

    async def make() -> AsyncLLM:
        return AsyncLLM(tiny_llama, plugin_host=host, **ENGINE_ARGS)

    llm = loop.run(make())
    recorder = RecordingLogger()
    llm.stat_loggers.loggers.append(recorder)
    llm.stat_loggers.names.append("recorder")
    llm.test_recorder = recorder
    llm.test_observer = observer
    yield llm
    llm.shutdown()


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(llm, prompt, params, request_id, *, delay: float = 0.0, kind=None):
    chunks, tokens, texts = 0, {}, {}
    last = None
    async for out in llm.generate(prompt, params, request_id, output_kind=kind):
        chunks += 1
        last = out
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            texts[c.index] = texts.get(c.index, "") + c.text
        if delay:
            await asyncio.sleep(delay)
    return chunks, tokens, texts, last


# --- the collector alone -----------------------------------------------------------------


def _out(text, ids, finished=False, index=0):
    reason = "length" if finished else None
    return RequestOutput(
        "r", "p", [1], [CompletionOutput(index, text, ids, finish_reason=reason)], finished
    )


def test_collector_merges_deltas_when_the_consumer_falls_behind():
    async def run():
        c = RequestOutputCollector("r", OutputKind.DELTA)
        c.put(_out("a", [1]))
        c.put(_out("b", [2]))
        c.put(_out("c", [3], index=1))
        c.put(_out("d", [4], finished=True))
        merged = await c.get()
        assert [x.index for x in merged.outputs] == [0, 1]
        assert merged.outputs[0].text == "abd" and merged.outputs[0].token_ids == [1, 2, 4]
        assert merged.outputs[1].token_ids == [3]
        assert merged.finished and c.finished and c.get_nowait() is None

    asyncio.run(run())


def test_collector_keeps_the_newest_cumulative_output_and_raises_errors():
    async def run():
        c = RequestOutputCollector("r", OutputKind.CUMULATIVE)
        c.put(_out("a", [1]))
        c.put(_out("ab", [1, 2]))
        assert (await c.get()).outputs[0].token_ids == [1, 2]
        c.put(_out("abc", [1, 2, 3]))
        c.put(EngineDeadError("boom"))
        with pytest.raises(EngineDeadError):
            await c.get()

    asyncio.run(run())


# --- AsyncLLM on a real engine ---------------------------------------------------------------


def test_generate_streams_deltas_that_add_up(loop, engine):
    chunks, tokens, texts, last = loop.run(collect(engine, "hello world", greedy(16), "a1"))
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert len(tokens[0]) == 16 and chunks >= 2
    assert texts[0] == engine.tokenizer.decode(tokens[0])
    # CUMULATIVE: each output holds everything so far.
    _, _, _, cum = loop.run(
        collect(engine, "hello world", greedy(16), "a2", kind=OutputKind.CUMULATIVE)
    )
    assert cum.outputs[0].token_ids == tokens[0] and cum.outputs[0].text == texts[0]


def test_slow_consumer_loses_and_duplicates_no_token(loop, engine):
    async def both():
        fast = asyncio.create_task(collect(engine, "the slow one", greedy(48), "fast"))
        slow = asyncio.create_task(collect(engine, "the slow one", greedy(48), "slow", delay=0.05))
        return await fast, await slow

    fast, slow = loop.run(both())
    assert slow[1] == fast[1] and slow[2] == fast[2]
    assert len(slow[1][0]) == 48
    assert slow[0] < fast[0]  # same tokens, fewer (merged) chunks


def test_many_requests_with_tiny_output_chunks(loop, engine, monkeypatch):
    monkeypatch.setattr(async_llm_module, "OUTPUT_CHUNK_SIZE", 2)

    async def many():
        return await asyncio.gather(
            *[collect(engine, "same prompt", greedy(12), f"m{i}") for i in range(9)]
        )

    results = loop.run(many())
    assert all(r[1] == results[0][1] for r in results)


def test_n_2_fans_out_and_merges_back(loop, engine):
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    _, tokens, _, last = loop.run(collect(engine, "parallel", params, "n2"))
    assert sorted(tokens) == [0, 1] and all(len(t) == 10 for t in tokens.values())
    assert last.finished and last.request_id == "n2"
    again = loop.run(collect(engine, "parallel", params, "n2b"))[1]
    assert again == tokens  # seeded: reproducible


def test_stop_string_never_leaks_into_the_stream(loop, engine):
    _, _, texts, _ = loop.run(collect(engine, "stop test", greedy(24), "s0"))
    full = texts[0]
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert stop.strip(), full
    expected = full[: full.index(stop)]
    _, _, texts2, last = loop.run(collect(engine, "stop test", greedy(24, stop=[stop]), "s1"))
    assert texts2[0] == expected
    assert last.outputs[0].finish_reason == "stop"


def test_breaking_out_aborts_the_request(loop, engine):
    async def run():
        got = 0
        async for _ in engine.generate("abort me", greedy(400), "brk"):
            got += 1
            if got == 3:
                break
        for _ in range(100):
            if await engine.get_num_unfinished_requests() == 0:
                return True
            await asyncio.sleep(0.02)
        return False

    assert loop.run(run())
    assert "brk" not in engine.collectors and not engine.output_processor.states
    aborted = [f for f in engine.test_observer.finished if f.request_id == "brk"]
    assert aborted and aborted[0].finish_reason == "abort"


def test_cancelling_the_consumer_task_and_abort_by_id(loop, engine):
    async def run():
        async def consume(rid):
            return await collect(engine, "cancel me", greedy(400), rid)

        task = asyncio.create_task(consume("cancelled"))
        await asyncio.sleep(0.3)
        task.cancel()
        other = asyncio.create_task(consume("by-id"))
        await asyncio.sleep(0.3)
        engine.abort("by-id")
        _, tokens, _, last = await other
        for _ in range(100):
            if await engine.get_num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.02)
        return last, tokens, await engine.get_num_unfinished_requests()

    last, tokens, unfinished = loop.run(run())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(tokens[0]) < 400 and unfinished == 0


def test_invalid_requests_raise_before_anything_runs(loop, engine):
    async def run(prompt, rid, params=None):
        async for _ in engine.generate(prompt, params or greedy(4), rid):
            pass

    with pytest.raises(InvalidRequestError):
        loop.run(run("word " * 600, "too-long"))
    with pytest.raises(InvalidRequestError):
        loop.run(run([], "empty"))


def test_stat_loggers_and_request_finished_hook_see_every_step(loop, engine):
    recorder, observer = engine.test_recorder, engine.test_observer
    before = len(recorder.records)
    params = greedy(8, extra={"tenant": "t1"})
    loop.run(collect(engine, "stats please", params, "stats-1"))
    engine.stat_loggers.flush()  # the steps hand their records over without waiting
    records = recorder.records[before:]
    iterations = [it for _, it in records if it is not None]
    assert sum(it.num_generation_tokens for it in iterations) == 8
    assert len([t for it in iterations for t in it.time_to_first_tokens]) == 1
    assert len([t for it in iterations for t in it.inter_token_latencies]) == 7
    assert any(s is not None and s.step_counter for s, _ in records)
    finished = [f for it in iterations for f in it.finished_requests]
    assert [f.request_id for f in finished] == ["stats-1"]
    assert finished[0].extra == {"tenant": "t1"} and finished[0].num_generation_tokens == 8
    assert finished[0].ttft > 0 and finished[0].e2e_latency >= finished[0].ttft
    assert any(f.request_id == "stats-1" for f in observer.finished)


def test_utilities(loop, engine, tiny_llama):
    async def run():
        assert await engine.is_paused() is False
        await engine.pause("keep")
        assert await engine.is_paused() is True
        await engine.resume()
        await engine.sleep(1)
        assert await engine.is_sleeping() is True
        await engine.wake_up()
        assert await engine.is_sleeping() is False
        assert await engine.reset_prefix_cache() in (True, False)
        await engine.check_health()
        ranks = await engine.collective_rpc("get_kv_cache_block_bytes")
        return ranks

    ranks = loop.run(run())
    assert len(ranks) == 1 and ranks[0] > 0
    _, tokens, _, _ = loop.run(collect(engine, "after sleep", greedy(4), "after"))
    assert len(tokens[0]) == 4


def test_engine_death_fails_every_open_request_at_once(loop, tiny_llama):
    async def make() -> AsyncLLM:
        return AsyncLLM(tiny_llama, **ENGINE_ARGS)

    llm = loop.run(make())
    try:

        async def run():
            tasks = [
                asyncio.create_task(collect(llm, "doomed", greedy(400), f"d{i}")) for i in range(3)
            ]
            await asyncio.sleep(0.3)
            os.kill(llm.ready.pid, signal.SIGKILL)
            started = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - started

        results, waited = loop.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert waited < 5
        with pytest.raises(EngineDeadError):
            loop.run(collect(llm, "late", greedy(2), "late"))
        with pytest.raises(EngineDeadError):
            loop.run(llm.check_health())
    finally:
        llm.shutdown()
