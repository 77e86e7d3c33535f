"""Data parallelism with local replicas (backend ``mp``): real engine processes over ZeroMQ.

Greedy output with two replicas equals transformers token for token; the coordinator
spreads requests and honours an explicit rank; aborts reach the owning replica; utility
calls fan out; stats are per engine plus an aggregate line; a replica killed with SIGKILL
fails only its own requests while the other keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from enginecore import LLM, AsyncLLM, SamplingParams
from enginecore.config import make_config
from enginecore.engine.client import make_client
from enginecore.engine.dp_coordinator import DPCoordinator, check_data_parallel_rank
from enginecore.errors import ConfigError, EngineCoreError, EngineDeadError, InvalidRequestError
from enginecore.protocol import SchedulerStats
from tests.helpers.event_loop import LoopThread, RecordingLogger
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DP_ARGS = dict(data_parallel_size=2, dtype="float32", num_blocks_override=128, max_model_len=512)


# --- the coordinator --------------------------------------------------------------------


def test_coordinator_prefers_fewer_waiting_then_fewer_running() -> None:
    coordinator = DPCoordinator(2)
    # A burst before any replica reported: alternate.
    picks = []
    for _ in range(4):
        index = coordinator.choose()
        coordinator.on_added(index)
        picks.append(index)
    assert picks == [0, 1, 0, 1]
    # Replica 0 runs both of its requests; replica 1 runs none (both wait): 0 is cheaper.
    coordinator.on_stats(0, SchedulerStats(num_running_reqs=2))
    coordinator.on_stats(1, SchedulerStats(num_running_reqs=0))
    assert coordinator.score(0) == 2 and coordinator.score(1) == 8
    assert coordinator.choose() == 0
    # Finished requests leave the count.
    coordinator.on_done(1, 2)
    assert coordinator.score(1) == 0
    assert coordinator.choose() == 1


def test_coordinator_explicit_rank_external_lb_and_dead_replicas() -> None:
    coordinator = DPCoordinator(2)
    assert coordinator.choose(1) == 1
    with pytest.raises(InvalidRequestError, match=r"out of range.*ranks 0\.\.1"):
        coordinator.choose(2)
    coordinator.on_dead(1, "SIGKILL")
    with pytest.raises(EngineDeadError, match="replica 1 is dead"):
        coordinator.choose(1)
    assert {coordinator.choose() for _ in range(3)} == {0}
    coordinator.on_dead(0, "gone")
    with pytest.raises(EngineDeadError, match="every data-parallel replica is dead"):
        coordinator.choose()
    external = DPCoordinator(2, external_lb=True)
    with pytest.raises(InvalidRequestError, match="data_parallel_external_lb"):
        external.choose()
    assert external.choose(0) == 0


def test_coordinator_counts_served_and_takes_a_restarted_replica_back() -> None:
    coordinator = DPCoordinator(2)
    coordinator.on_added(1)
    coordinator.on_served(1)
    coordinator.on_added(0)
    coordinator.on_done(0)  # aborted: not served
    assert coordinator.served == [0, 1] and coordinator.in_flight == [0, 0]
    coordinator.on_added(1, 3)
    coordinator.on_dead(1, "node lost")
    assert {coordinator.choose() for _ in range(3)} == {0}
    coordinator.on_restarted(1)
    assert coordinator.alive() == [0, 1] and coordinator.in_flight == [0, 0]
    assert coordinator.choose(1) == 1
    assert {coordinator.choose() for _ in range(2)} == {0, 1}  # balanced again


def test_data_parallel_backend_auto_and_failover_modes() -> None:
    def backend(**overrides) -> str:
        return make_config(model="unused", **overrides).parallel.data_parallel_backend

    assert backend() == "mp"
    assert backend(executor="ray") == "ray"
    assert backend(ray_address="auto") == "ray"
    assert backend(executor="ray", data_parallel_backend="mp") == "mp"
    assert make_config(model="unused").parallel.data_parallel_failover == "error"
    with pytest.raises(ConfigError, match="data_parallel_failover"):
        make_config(model="unused", data_parallel_failover="twice")


def test_rank_checks_before_a_request_is_tracked() -> None:
    check_data_parallel_rank(2, False, None)
    check_data_parallel_rank(2, True, 1)
    check_data_parallel_rank(1, True, None)  # one replica: nothing to choose
    for bad in (2, -1, True, "1"):
        with pytest.raises(
            InvalidRequestError, match=r"data_parallel_rank must be an int in 0\.\.1"
        ):
            check_data_parallel_rank(2, False, bad)
    with pytest.raises(InvalidRequestError, match="must name its replica"):
        check_data_parallel_rank(2, True, None)


def test_bad_data_parallel_configs_are_rejected(tiny_llama) -> None:
    with pytest.raises(ConfigError, match="data_parallel_backend"):
        make_config(model=str(tiny_llama), data_parallel_backend="slurm")
    with pytest.raises(ConfigError, match="multiprocessing = true"):
        make_client(make_config(model=str(tiny_llama), data_parallel_size=2, multiprocessing=False))
    with pytest.raises(ConfigError, match="external_launcher"):
        make_client(
            make_config(model=str(tiny_llama), data_parallel_size=2, executor="external_launcher")
        )


# --- LLM ------------------------------------------------------------------------------


def test_llm_dp2_greedy_matches_transformers_and_fans_out_utilities(tiny_llama) -> None:
    prompts = mixed_prompts(5)[:8]
    with LLM(tiny_llama, **DP_ARGS) as llm:
        assert type(llm.engine_client).__name__ == "DPSyncMPClient"
        assert "2 replicas" in llm.engine_client.ready.components["data_parallel"]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        # Explicit ranks: the same prompts pinned to replica 1, then split per prompt.
        pinned = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, data_parallel_rank=1
        )
        split = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, data_parallel_rank=[1, 0]
        )
        with pytest.raises(InvalidRequestError, match=r"data_parallel_rank must be .* 0\.\.1"):
            llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, data_parallel_rank=5)
        assert llm.output_processor.states == {}
        # Utilities run on every replica: one collective_rpc answer per replica's rank.
        pids = llm.collective_rpc(_pid)
        assert len(pids) == 2 and len(set(pids)) == 2
        assert sorted(pids) == sorted(e.proc.pid for e in llm.engine_client.engines)
        assert llm.reset_prefix_cache() is True
        assert llm.engine_client.call_utility("get_num_unfinished_requests") == 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 8), "dp=2"
        )
    for out, again in zip(outputs[:2], pinned, strict=True):
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
    for out, again in zip(outputs[:2], split, strict=True):
        assert again.outputs[0].token_ids == out.outputs[0].token_ids


def _pid_fn():
    """A function made inside another one travels by value (cloudpickle) to the workers."""

    def pid(worker) -> int:
        import os

        return os.getpid()

    return pid


_pid = _pid_fn()


# --- AsyncLLM ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    runner = LoopThread()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def dp_engine(loop, tiny_llama):
    async def make() -> AsyncLLM:
        # No periodic log task: its log() would reset the counters this module reads.
        return AsyncLLM(tiny_llama, stat_loggers=["logging"], log_stats_interval=0, **DP_ARGS)

    llm = loop.run(make())
    recorder = RecordingIndexes()
    llm.stat_loggers.loggers.append(recorder)
    llm.stat_loggers.names.append("recorder")
    llm.stat_loggers.engines.append(None)
    llm.recorder = recorder
    yield llm
    llm.shutdown()


class RecordingIndexes(RecordingLogger):
    def record(self, scheduler_stats, iteration_stats, engine_index=0) -> None:
        self.records.append((engine_index, scheduler_stats, iteration_stats))


async def _run(llm: AsyncLLM, prompt, rank=None, max_tokens=8) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    async for out in llm.generate({"prompt_token_ids": prompt}, params, data_parallel_rank=rank):
        tokens += out.outputs[0].token_ids
    return tokens


def test_async_requests_spread_over_replicas_and_stats_are_per_engine(loop, dp_engine) -> None:
    llm = dp_engine
    prompts = mixed_prompts(6)[:8]

    async def go():
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        collectors = [llm.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
        owners = [llm.engine_client.engine_of(c.request_id) for c in collectors]
        results = await asyncio.gather(*[_collect(llm, c) for c in collectors])
        return owners, results

    owners, results = loop.run(go())
    assert sorted(owners) == [0, 0, 0, 0, 1, 1, 1, 1]
    for prompt, tokens in zip(prompts, results, strict=True):
        assert_matches_reference(tokens, greedy_reference(llm.config.model.path, prompt, 6), "dp")
    llm.stat_loggers.flush()  # the steps hand their records over without waiting
    tokens_by_engine = {0: 0, 1: 0}
    for index, _, iteration in llm.recorder.records:
        if iteration is not None:
            tokens_by_engine[index] += iteration.num_generation_tokens
    assert tokens_by_engine == {0: 24, 1: 24}
    # One logging logger per engine, plus the aggregate line over both.
    names = llm.stat_loggers.names
    assert names.count("logging") == 2 and "logging (all engines)" in names
    per_engine = [
        lg for n, lg in zip(names, llm.stat_loggers.loggers, strict=True) if n == "logging"
    ]
    assert [lg.engine_index for lg in per_engine] == [0, 1]
    assert [lg.num_generation_tokens for lg in per_engine] == [24, 24]
    aggregate = llm.stat_loggers.loggers[names.index("logging (all engines)")]
    assert aggregate.num_generation_tokens == 48
    assert aggregate.format_line().startswith("Engines 000-001: ")


async def _collect(llm: AsyncLLM, collector) -> list[int]:
    tokens = []
    async for out in llm.stream(collector):
        tokens += out.outputs[0].token_ids
    return tokens


def test_async_explicit_rank_abort_routing_and_utilities(loop, dp_engine) -> None:
    llm = dp_engine
    prompt = mixed_prompts(7)[3]

    async def go():
        pinned = await _run(llm, prompt, rank=1)
        # A long request on replica 1, aborted after its first output: the abort must
        # reach replica 1 (replica 0 never knew the request).
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        collector = llm.add_request("long", {"prompt_token_ids": prompt}, params,
                                    data_parallel_rank=1)  # fmt: skip
        owner = llm.engine_client.engine_of("long")
        await collector.get()
        assert (
            await llm.engine_client.call_utility_async(
                "get_num_unfinished_requests", engine_index=1
            )
            == 1
        )
        llm.abort("long")
        left = [
            await llm.engine_client.call_utility_async(
                "get_num_unfinished_requests", engine_index=i
            )
            for i in (0, 1)
        ]
        await llm.pause("keep")
        paused = await llm.is_paused()
        per_replica = [
            await llm.engine_client.call_utility_async("is_paused", engine_index=i) for i in (0, 1)
        ]
        await llm.resume()
        resumed = await llm.is_paused()
        await llm.sleep(1)
        asleep = [
            await llm.engine_client.call_utility_async("is_sleeping", engine_index=i)
            for i in (0, 1)
        ]
        await llm.wake_up()
        assert asleep == [True, True] and await llm.is_sleeping() is False
        awake_again = await _run(llm, prompt, max_tokens=3)
        rpc = await llm.collective_rpc(_pid)
        with pytest.raises(InvalidRequestError, match="data_parallel_rank"):
            llm.add_request("bad", {"prompt_token_ids": prompt}, None, data_parallel_rank=2)
        return pinned, owner, left, paused, per_replica, resumed, rpc, awake_again

    pinned, owner, left, paused, per_replica, resumed, rpc, awake_again = loop.run(go())
    assert awake_again == pinned[:3]
    assert_matches_reference(pinned, greedy_reference(llm.config.model.path, prompt, 8), "rank 1")
    assert owner == 1
    assert left == [0, 0]
    assert paused is True and per_replica == [True, True] and resumed is False
    assert len(rpc) == 2 and len(set(rpc)) == 2
    assert "bad" not in llm.collectors and llm.output_processor.states == {}


def test_sigkill_of_one_replica_fails_only_its_requests(loop, tiny_llama) -> None:
    async def make() -> AsyncLLM:
        return AsyncLLM(tiny_llama, stat_loggers=[], **DP_ARGS)

    llm = loop.run(make())
    try:
        prompt = mixed_prompts(8)[2]

        async def go():
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            doomed = llm.add_request("on-1", {"prompt_token_ids": prompt}, params,
                                     data_parallel_rank=1)  # fmt: skip
            survivor = llm.add_request("on-0", {"prompt_token_ids": prompt}, params,
                                       data_parallel_rank=0)  # fmt: skip
            await doomed.get()
            await survivor.get()
            os.kill(llm.engine_client.engines[1].proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="replica 1 died"):
                await _collect(llm, doomed)
            rest = await _collect(llm, survivor)
            with pytest.raises(EngineDeadError, match="replica 1 of 2 is dead"):
                await llm.check_health()
            with pytest.raises(EngineDeadError, match="replica 1 is dead"):
                llm.add_request("named-dead", {"prompt_token_ids": prompt}, params,
                                data_parallel_rank=1)  # fmt: skip
            after = await _run(llm, prompt)  # balanced: only replica 0 is left
            return rest, after

        rest, after = loop.run(go())
        assert rest, "the request on the live replica kept streaming"
        assert llm.output_processor.states == {} and llm.collectors == {}
        assert not llm.errored
        assert_matches_reference(after, greedy_reference(tiny_llama, prompt, 8), "survivor")
    finally:
        llm.shutdown()


def test_a_replica_that_fails_to_start_is_named_and_none_is_left(tiny_llama, tmp_path) -> None:
    import psutil

    # Corrupt weights: only the replicas find out (a bad name fails before any starts).
    bad = tmp_path / "bad-weights"
    bad.mkdir()
    for f in tiny_llama.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineCoreError, match=r"data-parallel replica [01]: .*SafetensorError"):
        LLM(bad, data_parallel_size=2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_an_unknown_component_fails_before_any_replica_starts(tiny_llama) -> None:
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="unknown model runner 'no_such_runner'"):
        LLM(tiny_llama, data_parallel_size=2, runner="no_such_runner")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
