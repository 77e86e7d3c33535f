"""The ``mp`` executor with real tensor parallelism: real worker processes, real gloo.

One TP=2 engine serves most tests (start-up is the expensive part); the death-chain test
runs last in the module and kills it with a real SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest

from enginecore import LLM, EngineDeadError, SamplingParams
from enginecore.engine.mp_client import UtilityError
from enginecore.errors import EngineCoreError
from tests.helpers.in_flight import wait_until_generating
from tests.helpers.process_kinds import is_kind

PROMPTS = ["hello world", "the quick brown fox jumps", "a b c d e f g", "x"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
COMMON = dict(dtype="float32", num_blocks_override=256, max_model_len=2048)


@pytest.fixture(scope="module")
def tp1_reference(tiny_llama):
    with LLM(tiny_llama, multiprocessing=False, **COMMON) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        block_bytes = llm.collective_rpc("get_kv_cache_block_bytes")[0]
    return outputs, block_bytes


@pytest.fixture(scope="module")
def tp2(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, **COMMON)
    yield llm
    llm.shutdown()


def _worker_pids(llm: LLM) -> list[int]:
    return llm.collective_rpc("get_pid")


def test_auto_picks_mp_and_spawns_one_process_per_rank(tp2) -> None:
    assert tp2.engine_client.ready.components["executor"].startswith("mp ")
    pids = _worker_pids(tp2)
    engine = tp2.engine_client.proc.pid
    assert len(set(pids)) == 2 and engine not in pids and os.getpid() not in pids
    for pid in pids:
        proc = psutil.Process(pid)
        assert proc.ppid() == engine
        # spawned fresh (python -m ...), not a fork of the engine: a worker by its title
        assert is_kind(proc, "worker") and not is_kind(proc, "engine")
    assert tp2.collective_rpc("get_rank") == [0, 1]


def test_no_process_of_the_engine_listens_on_all_interfaces(tp2) -> None:
    """The ranks' rendezvous store is a file in the executor's owner-only directory, not a
    TCP store (which listens on every interface, unauthenticated)."""
    engine = psutil.Process(tp2.engine_client.proc.pid)
    wide = []
    for proc in [engine, *engine.children(recursive=True)]:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.ip in ("0.0.0.0", "::"):
                wide.append((proc.pid, conn.laddr))
    assert not wide, f"listening on all interfaces: {wide}"


def test_tp2_greedy_tokens_and_logprobs_match_tp1(tp2, tp1_reference) -> None:
    reference, _ = tp1_reference
    outputs = tp2.generate(PROMPTS, GREEDY)
    for got, want in zip(outputs, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_lp, want_lp in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            for token, lp in want_lp.items():
                # gloo's all-reduce sums in a different order: close, not bitwise
                assert got_lp[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_every_rank_holds_its_shard_and_its_share_of_the_kv_cache(tp2, tp1_reference) -> None:
    _, tp1_block_bytes = tp1_reference

    def shapes(worker):
        attn = worker.model_runner.model.model.layers[0].self_attn
        emb = worker.model_runner.model.model.embed_tokens
        return (
            tuple(attn.qkv_proj.weight.shape),
            attn.num_heads,
            attn.num_kv_heads,
            tuple(emb.weight.shape),
            tuple(worker.model_runner.kv_caches[0].shape),
        )

    rank0, rank1 = tp2.collective_rpc(shapes)  # tuples come back as lists (msgpack)
    assert rank0 == rank1
    qkv, heads, kv_heads, emb, kv = (tuple(x) if isinstance(x, list) else x for x in rank0)
    # tiny: hidden 256, 4 heads, 2 KV heads (head_dim 64), vocab 8192
    assert (heads, kv_heads) == (2, 1)
    assert qkv == ((2 + 1 + 1) * 64, 256)
    assert emb == (4096, 256)
    assert kv[3] == 1  # [2, blocks, block_size, kv_heads, head_dim]
    assert tp2.collective_rpc("get_kv_cache_block_bytes") == [tp1_block_bytes // 2] * 2


def test_collective_rpc_errors_name_the_rank_and_the_engine_stays_up(tp2) -> None:
    with pytest.raises(
        UtilityError, match="no worker method or registered worker RPC named 'nope'"
    ):
        tp2.collective_rpc("nope")

    def fail_on_rank_1(worker):
        if worker.rank == 1:
            raise RuntimeError("only rank one fails")
        return worker.rank

    with pytest.raises(UtilityError, match=r"rank 1 raised.*only rank one fails"):
        tp2.collective_rpc(fail_on_rank_1)
    with pytest.raises(UtilityError, match="timed out"):
        tp2.collective_rpc(lambda w: time.sleep(1.0), timeout=0.2)
    time.sleep(1.0)
    assert tp2.collective_rpc(lambda w, x: (w.rank, x), args=(3,)) == [[0, 3], [1, 3]]
    out = tp2.generate("still up", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_sigkill_of_a_rank_fails_every_request_naming_the_rank(tp2) -> None:
    """Runs last: it kills the module's engine."""
    pids = _worker_pids(tp2)
    result: dict = {}

    def run() -> None:
        try:
            result["outputs"] = tp2.generate(
                ["one", "two", "three"],
                SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True),
            )
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until_generating(tp2, 3)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(10)
    assert not thread.is_alive()
    elapsed = time.monotonic() - killed_at
    error = result.get("error")
    assert isinstance(error, EngineDeadError), result
    assert f"rank 1 (pid {pids[1]}) died with exit code -9" in str(error)
    assert elapsed < 5, elapsed
    with pytest.raises(EngineDeadError):
        tp2.generate("after", SamplingParams(max_tokens=2))
    # The surviving rank does not linger once the engine is gone.
    engine = tp2.engine_client.proc
    tp2.shutdown()
    engine.wait(10)
    psutil.wait_procs([psutil.Process(pids[0])], timeout=10) if psutil.pid_exists(pids[0]) else None
    assert not _alive(pids[0])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_that_fails_to_start_is_named_and_nothing_is_left_behind(tmp_path, tiny_llama):
    from enginecore.config import make_config
    from enginecore.engine.mp_client import SyncMPClient

    bad = tmp_path / "bad-weights"
    bad.mkdir()
    for f in tiny_llama.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)  # corrupt weights
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EngineCoreError, match=r"rank [01] failed to start: .*safetensors"):
        SyncMPClient(make_config(model=str(bad), tensor_parallel_size=2, dtype="float32"))
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [p for p in left if _alive(p.pid)], left


@pytest.mark.slow
def test_a_stopped_rank_trips_the_watchdog_naming_it(tiny_llama) -> None:
    """SIGSTOP leaves the process alive, so only the execute_timeout watchdog notices."""
    llm = LLM(tiny_llama, executor="mp", execute_timeout=3.0, **COMMON)
    (pid,) = _worker_pids(llm)
    try:
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as caught:
            llm.generate(["hello"], SamplingParams(max_tokens=20, ignore_eos=True))
        waited = time.monotonic() - started
        message = str(caught.value)
        assert f"rank 0 (pid {pid}) is stopped" in message, message
        assert "execute_timeout" in message
        assert waited < 30, waited
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        llm.shutdown()
