"""The engine core in its own process: handshake, utilities, aborts, death and shutdown.

Real processes over real ZeroMQ sockets; death is tested by killing them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import psutil
import pytest

from enginecore import LLM, EngineDeadError, InvalidRequestError, SamplingParams
from enginecore.engine.mp_client import SyncMPClient, UtilityError
from tests.helpers.in_flight import wait_until_generating

LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


#: The module engine's KV cache: 256 MiB of the tiny model's 64 KiB blocks, enough for
#: the sleep test to see its memory freed.
NUM_BLOCKS = 4096


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(
        tiny_llama, dtype="float32", num_blocks_override=NUM_BLOCKS, max_model_len=2048
    ) as llm:
        yield llm


def engine_pid(llm: LLM) -> int:
    return llm.engine_client.proc.pid


def test_llm_defaults_to_a_separate_engine_process(llm) -> None:
    assert isinstance(llm.engine_client, SyncMPClient)
    pid = engine_pid(llm)
    assert pid != os.getpid()
    assert llm.collective_rpc("get_pid") == [pid]  # the uni worker lives in the engine process


def test_handshake_carries_final_sizes_and_frontend_validates_against_them(llm) -> None:
    ready = llm.engine_client.ready
    assert ready.num_blocks == NUM_BLOCKS and ready.block_size == 16
    assert ready.max_model_len == 2048
    assert "scheduler" in ready.components and "builtin_schedulers" in ready.components["scheduler"]
    with pytest.raises(InvalidRequestError, match="max_model_len is 2048"):
        llm.generate({"prompt_token_ids": [5] * 2048}, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    # The engine keeps serving after rejected input.
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_utilities_and_a_utility_that_raises(llm) -> None:
    assert llm.engine_client.call_utility("ping") == "pong"
    assert llm.engine_client.call_utility("get_supported_tasks") == ["generate"]
    assert llm.reset_prefix_cache() is True
    with pytest.raises(
        UtilityError, match="no worker method or registered worker RPC named 'nope'"
    ):
        llm.collective_rpc("nope")
    with pytest.raises(UtilityError, match="not a utility method"):
        llm.engine_client.call_utility("shutdown")
    # A name once listed with no method behind it: refused like any unknown name.
    with pytest.raises(UtilityError, match="'profile' is not a utility method"):
        llm.engine_client.call_utility("profile")

    def fails(worker):
        raise RuntimeError("rank-side failure")

    with pytest.raises(UtilityError, match=r"rank 0 raised.*rank-side failure"):
        llm.collective_rpc(fails)
    assert llm.collective_rpc(lambda worker, x: x * 2, args=(21,)) == [42]
    assert llm.engine_client.call_utility("ping") == "pong"  # still up


def test_abort_is_idempotent_and_frees_blocks(llm) -> None:
    llm.abort(["never-existed"])  # unknown id: no-op
    out = llm.generate("x", SamplingParams(max_tokens=2, ignore_eos=True))
    llm.abort([out[0].request_id])  # finished id: no-op
    assert llm.engine_client.call_utility("get_num_unfinished_requests") == 0


def test_idle_engine_uses_almost_no_cpu(llm) -> None:
    proc = psutil.Process(engine_pid(llm))
    time.sleep(0.5)  # let the last step settle
    before = proc.cpu_times()
    time.sleep(2.0)
    after = proc.cpu_times()
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.3, f"idle engine used {used:.2f} s of CPU in 2 s"


def test_pause_modes_and_resume(llm) -> None:
    client = llm.engine_client
    client.call_utility("pause_scheduler", "abort")
    assert client.call_utility("is_paused") is True
    out = llm.generate("paused", SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].finish_reason == "error"  # rejected, retryable after resume
    client.call_utility("resume_scheduler")
    assert client.call_utility("is_paused") is False
    out = llm.generate("resumed", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(UtilityError, match="pause mode"):
        client.call_utility("pause_scheduler", "sideways")


def touch_kv_cache(worker) -> None:
    for cache in worker.model_runner.kv_caches:
        cache.fill_(0)


def test_a_callable_the_engine_cannot_unpickle_is_a_clear_error(llm, monkeypatch) -> None:
    # A module that exists in this process only: the callable is pickled by reference to
    # it, and the engine process cannot import it.
    only_here = types.ModuleType("callables_of_the_test_process")
    callable_here = types.FunctionType(touch_kv_cache.__code__, touch_kv_cache.__globals__)
    callable_here.__module__ = only_here.__name__
    only_here.touch_kv_cache = callable_here
    monkeypatch.setitem(sys.modules, only_here.__name__, only_here)
    with pytest.raises(UtilityError, match=r"could not be unpickled.*callables_of_the_test"):
        llm.collective_rpc(callable_here)
    assert llm.engine_client.call_utility("ping") == "pong"


def test_sleep_frees_kv_cache_memory_and_wake_up_restores(llm) -> None:
    proc = psutil.Process(engine_pid(llm))
    before = llm.generate("a b c", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))

    # KV pages are committed on first touch: touch them all, as a long run would.
    def touch(worker) -> None:  # nested, so it is pickled by value
        for cache in worker.model_runner.kv_caches:
            cache.fill_(0)

    llm.collective_rpc(touch)
    rss_awake = proc.memory_info().rss
    llm.engine_client.call_utility("sleep", 1)
    assert llm.engine_client.call_utility("is_sleeping") is True
    rss_asleep = proc.memory_info().rss
    llm.engine_client.call_utility("wake_up")
    after = llm.generate("a b c", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert rss_awake - rss_asleep > 128 * 1024 * 1024, (rss_awake, rss_asleep)
    assert after[0].outputs[0].token_ids == before[0].outputs[0].token_ids


def _generate_in_thread(llm: LLM, result: dict) -> threading.Thread:
    def run() -> None:
        started = time.monotonic()
        try:
            result["outputs"] = llm.generate(["one", "two", "three"], LONG)
        except BaseException as exc:
            result["error"] = exc
        result["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigkill_of_the_engine_fails_every_request_quickly(tiny_llama) -> None:
    llm = LLM(tiny_llama, dtype="float32", num_blocks_override=512, max_model_len=4096)
    try:
        pid = engine_pid(llm)
        result: dict = {}
        thread = _generate_in_thread(llm, result)
        wait_until_generating(llm, 3)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive()
        error = result.get("error")
        assert isinstance(error, EngineDeadError), result
        assert str(pid) in str(error) and "-9" in str(error)
        assert time.monotonic() - killed_at < 5
        with pytest.raises(EngineDeadError):  # and every later call too
            llm.generate("after", SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


@pytest.mark.timeout(120)
def test_a_send_to_a_dead_engine_fails_instead_of_hanging(tiny_llama) -> None:
    """A call that sends while the engine dies, before the reader thread has noticed: the
    engine's end of the input socket is gone, where a send would wait for a reader
    forever. The reader is stopped first so that the send, not the reader, must notice."""
    llm = LLM(tiny_llama, dtype="float32", num_blocks_override=256, max_model_len=512)
    client = llm.engine_client
    try:
        client._stop.set()
        client._reader.join(10)
        os.kill(client.proc.pid, signal.SIGKILL)
        client.proc.wait(30)
        time.sleep(1.0)  # the socket has seen the connection close
        started = time.monotonic()
        request, _ = llm.input_processor.process("r0", "a b c", SamplingParams())
        with pytest.raises(EngineDeadError, match=str(client.proc.pid)):
            client.add_request(request)
        assert time.monotonic() - started < 5
    finally:
        llm.shutdown()


def test_engine_loop_error_reaches_the_frontend_with_its_text(tiny_llama) -> None:
    with LLM(tiny_llama, dtype="float32", num_blocks_override=128) as llm:

        def break_the_runner(worker):
            def boom(*args, **kwargs):
                raise RuntimeError("simulated kernel failure")

            worker.model_runner.execute_model = boom

        llm.collective_rpc(break_the_runner)
        with pytest.raises(
            EngineDeadError, match=r"rank 0 raised in execute_model.*simulated kernel failure"
        ):
            llm.generate("hello", SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    ("shutdown_timeout", "expected_reason"), [(0.0, "abort"), (60.0, "length")]
)
def test_sigterm_aborts_or_drains_in_flight_requests(
    tiny_llama, shutdown_timeout: float, expected_reason: str
) -> None:
    llm = LLM(
        tiny_llama,
        dtype="float32",
        num_blocks_override=512,
        max_model_len=4096,
        shutdown_timeout=shutdown_timeout,
    )
    try:
        result: dict = {}
        params = (
            LONG if expected_reason == "abort" else SamplingParams(max_tokens=60, ignore_eos=True)
        )

        def run() -> None:
            try:
                result["outputs"] = llm.generate(["one", "two"], params)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        wait_until_generating(llm, 2)
        os.kill(engine_pid(llm), signal.SIGTERM)
        thread.join(60)
        assert "outputs" in result, result
        reasons = {o.outputs[0].finish_reason for o in result["outputs"]}
        assert reasons == {expected_reason}
        assert llm.engine_client.proc.wait(10) == 0  # a clean exit, not a crash
    finally:
        llm.shutdown()


def test_no_engine_process_outlives_the_interpreter(tiny_llama, tmp_path) -> None:
    script = tmp_path / "leaky.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from enginecore import LLM, SamplingParams
            llm = LLM({str(tiny_llama)!r}, dtype="float32", num_blocks_override=64)
            print(llm.engine_client.proc.pid, flush=True)
            llm.generate("hi", SamplingParams(max_tokens=2))
            # no shutdown(): garbage collection / interpreter exit must clean up
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert not alive, f"engine process {pid} outlived its frontend"


def test_engine_startup_failure_is_reported_with_its_cause(tmp_path) -> None:
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(
        '{"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}'
    )
    from enginecore.config import make_config
    from enginecore.errors import EngineCoreError

    with pytest.raises(EngineCoreError, match="NoSuchForCausalLM"):
        SyncMPClient(make_config(model=str(bad)))


def test_a_rank_error_keeps_its_type_and_rank_across_the_process_boundary(llm) -> None:
    """docs/executors.md promises RankError whatever the process mode."""
    from enginecore.errors import RankError

    def fails(worker):
        raise KeyError("missing shard")

    with pytest.raises(RankError) as info:
        llm.collective_rpc(fails)
    assert info.value.rank == 0 and info.value.method == "fails"
    assert str(info.value) == "rank 0 raised in fails: KeyError: 'missing shard'"
    assert isinstance(info.value, UtilityError)  # still a failed utility call
