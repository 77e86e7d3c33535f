"""``KVConnectorContract``: the behaviour every KV connector plugin owes the engine.

Subclass it in your own pytest tests and point it at your connector::

    from enginecore.testing import KVConnectorContract

    class TestMyConnector(KVConnectorContract):
        connector = "my-connector"              # a registered name

        def producer_kv_transfer(self, tmp_path):   # the instance that computes
            return {"connector": "my-connector", "extra_config": {"path": str(tmp_path)}}

        def consumer_kv_transfer(self, tmp_path):   # the instance that loads
            return self.producer_kv_transfer(tmp_path)

The suite runs a real workload on real engines (in-process ``EngineCore``, ``uni``
executor, torch runner, a small random Llama checkpoint): a *producer* engine computes a
set of prompts (``max_tokens=1``, with :meth:`producer_request_params`), then a
*consumer* engine generates from the same prompts, passing each producer output's
``kv_transfer_params`` back (:meth:`consumer_request_params`); one consumer request is
aborted while its KV is loading. Both halves of the connector are wrapped by recorders,
and the tests check the trace:

* matched tokens are block-aligned, never reach past ``prompt - 1`` and the call is
  free of side effects (asked twice, same answer);
* a request a step was saving (``save_request_ids`` of the metadata) finishes with
  ``delay_free``, and every ``delay_free`` request is reported in ``finished_sending``
  exactly once (until then the engine keeps its blocks);
* every asynchronous load is reported in ``finished_recving`` exactly once;
* the per-step metadata survives pickle and cloudpickle (how executors ship it to
  workers) and, for msgspec structs, msgpack;
* the consumer's greedy output equals a plain engine's and it computed less of the
  prompts; an aborted load frees its blocks; no engine leaks blocks or requests.
"""

from __future__ import annotations

import pickle
import random
import socket
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import cloudpickle
import msgspec
import pytest

from enginecore.config import make_config
from enginecore.engine.core import EngineCore
from enginecore.params import SamplingParams
from enginecore.protocol import EngineCoreRequest
from enginecore.request import Request, RequestStatus
from enginecore.runner_output import KVConnectorOutput
from enginecore.scheduler_output import SchedulerOutput

PROMPT_LENGTHS = (70, 64, 57, 10, 90)
SHARED_PREFIX = 40  # prompts 0 and 2 share this many tokens
ABORTED = "r-abort"


def free_port() -> int:
    """A free TCP port on loopback (for connectors that listen)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Trace:
    """What the recorders saw on the consumer and the producer."""

    matched: list[tuple[str, int, int, int | None, bool]] = field(default_factory=list)
    allocs: list[tuple[str, int, int]] = field(default_factory=list)
    finished: dict[str, list[bool]] = field(default_factory=dict)  # id -> delay_free calls
    metadata: list[Any] = field(default_factory=list)
    done_sending: list[str] = field(default_factory=list)
    done_recving: list[str] = field(default_factory=list)
    parked: set[str] = field(default_factory=set)  # ever WAITING_FOR_REMOTE_KVS


# The trace of each engine whose connector halves are wrapped.
_TRACES: weakref.WeakKeyDictionary[EngineCore, Trace] = weakref.WeakKeyDictionary()


class _SchedulerRecorder:
    """Delegates to the real scheduler half and records every call."""

    def __init__(self, inner: Any, trace: Trace) -> None:
        self.inner, self.trace = inner, trace

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        first: tuple[int | None, bool] = self.inner.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        again = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        assert first == again, (
            f"get_num_new_matched_tokens is not free of side effects: {first} then {again}"
        )
        num, load_async = first
        self.trace.matched.append(
            (request.request_id, request.num_prompt_tokens, num_computed_tokens, num, load_async)
        )
        return first

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.trace.allocs.append((request.request_id, len(block_ids), num_external_tokens))
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        meta = self.inner.build_connector_meta(scheduler_output)
        self.trace.metadata.append(meta)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        result: tuple[bool, dict[str, Any] | None] = self.inner.request_finished(request, block_ids)
        self.trace.finished.setdefault(request.request_id, []).append(bool(result[0]))
        return result

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(output)

    def shutdown(self) -> None:
        self.inner.shutdown()


class _WorkerRecorder:
    def __init__(self, inner: Any, trace: Trace) -> None:
        self.inner, self.trace = inner, trace

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.inner.get_finished(finished_req_ids)
        self.trace.done_sending.extend(sending or ())
        self.trace.done_recving.extend(recving or ())
        return sending, recving


def _prompts(seed: int = 0, vocab: int = 8000) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(10, vocab) for _ in range(SHARED_PREFIX)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    for i in (0, 2):
        prompts[i] = prefix + prompts[i][SHARED_PREFIX:]
    return prompts


class KVConnectorContract:
    """Subclass and set ``connector``; override the hooks below as your connector needs."""

    connector: ClassVar[str] = ""
    block_size: ClassVar[int] = 16
    max_tokens: ClassVar[int] = 6
    # True when the producer finishes its transfers on its own (writes to storage): the
    # consumer then starts once the producer is idle. False when they wait for the
    # consumer (point-to-point sends): both engines run side by side.
    producer_finishes_alone: ClassVar[bool] = True

    # --- what a plugin author adapts ------------------------------------------------------

    def producer_kv_transfer(self, tmp_path: Any) -> dict[str, Any]:
        """The ``kv_transfer`` section of the engine that computes the prompts."""
        return {"connector": self.connector}

    def consumer_kv_transfer(self, tmp_path: Any) -> dict[str, Any]:
        """The ``kv_transfer`` section of the engine that loads them."""
        return self.producer_kv_transfer(tmp_path)

    def producer_request_params(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` of the producer's requests."""
        return None

    def consumer_request_params(self, producer_params: dict[str, Any] | None) -> Any:
        """``kv_transfer_params`` of a consumer request, from the producer's output."""
        return producer_params

    # --- the scenario -----------------------------------------------------------------------

    @pytest.fixture(scope="class")
    def contract_run(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        from enginecore.checkpoints import make_random_checkpoint

        tmp = tmp_path_factory.mktemp("kv-contract")
        checkpoint = make_random_checkpoint(tmp / "llama", arch="llama", size="tiny", seed=0)
        prompts = _prompts()
        common: dict[str, Any] = dict(
            model=str(checkpoint),
            dtype="float32",
            block_size=self.block_size,
            num_blocks_override=96,
            max_model_len=512,
            async_scheduling=False,
        )
        reference = EngineCore(make_config(**common))
        try:
            expected = _generate(reference, prompts, self.max_tokens, [None] * len(prompts))
        finally:
            reference.shutdown()
        producer = EngineCore(make_config(kv_transfer=self.producer_kv_transfer(tmp), **common))
        consumer = None
        try:
            consumer = EngineCore(make_config(kv_transfer=self.consumer_kv_transfer(tmp), **common))
            producer_trace, consumer_trace = Trace(), Trace()
            _wrap(producer, producer_trace)
            _wrap(consumer, consumer_trace)
            # The last prompt twice: the copy is the consumer request aborted mid-load.
            produced = _generate(
                producer,
                [*prompts, prompts[-1]],
                1,
                [self.producer_request_params()] * (len(prompts) + 1),
            )
            if self.producer_finishes_alone:
                _drain(producer)  # e.g. storage writes land before the consumer looks
            handoffs = [self.consumer_request_params(p["kv_transfer_params"]) for p in produced]
            consumed = _generate(
                consumer,
                prompts,
                self.max_tokens,
                handoffs[:-1],
                peer=producer,
                abort=(prompts[-1], handoffs[-1]),
            )
            _drain(producer, consumer)
            leaks = {
                "producer": _scheduler(producer).leak_report(),
                "consumer": _scheduler(consumer).leak_report(),
            }
        finally:
            producer.shutdown()
            if consumer is not None:
                consumer.shutdown()
        return {
            "prompts": prompts,
            "expected": expected,
            "consumed": consumed,
            "producer": producer_trace,
            "consumer": consumer_trace,
            "leaks": leaks,
        }

    # --- the contract -------------------------------------------------------------------------

    def test_matched_tokens_are_aligned_and_leave_the_last_token(
        self, contract_run: dict[str, Any]
    ) -> None:
        bs = self.block_size
        seen = contract_run["consumer"].matched + contract_run["producer"].matched
        assert seen, "get_num_new_matched_tokens was never called"
        for req_id, prompt_len, computed, num, _async in seen:
            if not num:
                continue
            assert computed % bs == 0
            assert (computed + num) % bs == 0, f"{req_id}: {computed}+{num} not block-aligned"
            assert computed + num <= prompt_len - 1, (
                f"{req_id}: matched {computed}+{num} of a {prompt_len}-token prompt: the last "
                "prompt token must always be computed"
            )

    def test_consumer_output_matches_a_plain_engine(self, contract_run: dict[str, Any]) -> None:
        for i, expected in enumerate(contract_run["expected"]):
            got = contract_run["consumed"][i]
            assert got["error"] is None, got["error"]
            assert got["token_ids"] == expected["token_ids"], f"prompt {i}"

    def test_consumer_loaded_external_kv(self, contract_run: dict[str, Any]) -> None:
        external = [m for m in contract_run["consumer"].matched if m[3]]
        assert external, "the consumer never matched external tokens"
        cached = [r["num_cached_tokens"] for r in contract_run["consumed"]]
        assert max(cached) >= self.block_size, cached

    def test_delay_free_holds_blocks_until_finished_sending(
        self, contract_run: dict[str, Any]
    ) -> None:
        for trace in (contract_run["producer"], contract_run["consumer"]):
            held = {r for r, calls in trace.finished.items() if any(calls)}
            # A request whose KV a step was saving may still be read by that save.
            saving: set[str] = set()
            for meta in trace.metadata:
                saving |= set(getattr(meta, "save_request_ids", ()))
            assert saving & set(trace.finished) <= held, (
                "requests finished without delay_free while their KV was being saved: "
                f"{sorted((saving & set(trace.finished)) - held)}"
            )
            assert sorted(trace.done_sending) == sorted(set(trace.done_sending)), (
                "a request was reported in finished_sending more than once"
            )
            assert held <= set(trace.done_sending), (
                f"delay_free requests never reported finished_sending: {held - set(trace.done_sending)}"
            )

    def test_request_finished_is_called_once(self, contract_run: dict[str, Any]) -> None:
        for trace in (contract_run["producer"], contract_run["consumer"]):
            twice = {r: calls for r, calls in trace.finished.items() if len(calls) != 1}
            assert twice == {}

    def test_every_async_load_reported_once(self, contract_run: dict[str, Any]) -> None:
        trace = contract_run["consumer"]
        loads = {m[0] for m in trace.matched if m[3] and m[4]}
        assert sorted(trace.done_recving) == sorted(set(trace.done_recving)), (
            "a load was reported in finished_recving more than once"
        )
        assert loads <= set(trace.done_recving), (
            f"loads never reported finished_recving: {loads - set(trace.done_recving)}"
        )

    def test_abort_while_loading_frees_blocks(self, contract_run: dict[str, Any]) -> None:
        trace = contract_run["consumer"]
        if ABORTED not in trace.parked:
            pytest.skip("the request never waited for remote KV (a synchronous connector)")
        assert ABORTED in trace.done_recving
        assert contract_run["leaks"]["consumer"] == []

    def test_no_leaks(self, contract_run: dict[str, Any]) -> None:
        assert contract_run["leaks"] == {"producer": [], "consumer": []}

    def test_metadata_round_trips(self, contract_run: dict[str, Any]) -> None:
        metas = [m for t in ("producer", "consumer") for m in contract_run[t].metadata]
        assert metas, "build_connector_meta was never called"
        for meta in metas:
            assert pickle.loads(pickle.dumps(meta, protocol=5)) == meta
            assert cloudpickle.loads(cloudpickle.dumps(meta)) == meta
            if isinstance(meta, msgspec.Struct):
                raw = msgspec.msgpack.encode(meta)
                assert msgspec.msgpack.decode(raw, type=type(meta)) == meta


# --- driving engines -------------------------------------------------------------------------


def _scheduler(engine: EngineCore) -> Any:
    """The built-in scheduler, whose internals (``requests``, ``connector``,
    ``leak_report``) the contract reads: the ``Scheduler`` interface has none of them."""
    return engine.scheduler


def _wrap(engine: EngineCore, trace: Trace) -> None:
    scheduler = _scheduler(engine)
    if getattr(scheduler, "connector", None) is None:
        raise AssertionError("the engine built no KV connector: check kv_transfer")
    scheduler.connector = _SchedulerRecorder(scheduler.connector, trace)
    executor: Any = engine.executor  # the in-process executor: it holds the one worker
    runner = executor.worker.model_runner
    runner.kv_connector.connector = _WorkerRecorder(runner.kv_connector.connector, trace)
    _TRACES[engine] = trace


def _step(engine: EngineCore, results: dict[str, dict[str, Any]]) -> None:
    trace = _TRACES.get(engine)
    if trace is not None:
        for req_id, request in _scheduler(engine).requests.items():
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                trace.parked.add(req_id)
    outputs, _ = engine.step()
    for client_outputs in outputs.values():
        for out in client_outputs.outputs:
            entry = results.setdefault(
                out.request_id,
                {
                    "token_ids": [],
                    "error": None,
                    "kv_transfer_params": None,
                    "num_cached_tokens": 0,
                },
            )
            if out.new_token_ids and not entry["token_ids"]:
                entry["num_cached_tokens"] = out.num_cached_tokens
            entry["token_ids"].extend(out.new_token_ids)
            if out.error:
                entry["error"] = out.error
            if out.kv_transfer_params is not None:
                entry["kv_transfer_params"] = out.kv_transfer_params
            if out.finish_reason is not None:
                entry["finished"] = True


def _generate(
    engine: EngineCore,
    prompts: list[list[int]],
    max_tokens: int,
    params: list[Any],
    *,
    peer: EngineCore | None = None,
    abort: tuple[list[int], Any] | None = None,
) -> list[dict[str, Any]]:
    """Greedy-generate every prompt; the peer engine keeps stepping (it may serve KV)."""
    results: dict[str, dict[str, Any]] = {}
    for i, (prompt, kv_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(_request(f"r{i}", prompt, max_tokens, kv_params))
    if abort is not None:
        engine.add_request(_request(ABORTED, abort[0], max_tokens, abort[1]))
    ids = [f"r{i}" for i in range(len(prompts))]
    aborted = abort is None
    if abort is not None:

        def abort_while_loading() -> None:
            # Runs where the engine applies aborts that arrived during the forward pass,
            # i.e. while the step that started the load is in flight.
            request = _scheduler(engine).requests.get(ABORTED)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                _TRACES[engine].parked.add(ABORTED)
                engine.abort_requests([ABORTED])

        # This engine's hook for aborts that arrive mid-step, replaced to abort mid-load.
        engine._apply_pending_aborts = abort_while_loading  # type: ignore[method-assign]
    for _ in range(100_000):
        if all(results.get(r, {}).get("finished") for r in ids) and aborted:
            break
        _step(engine, results)
        if peer is not None and peer.has_work():
            _step(peer, {})
        if not aborted and ABORTED not in _scheduler(engine).requests:
            aborted = True  # aborted mid-load (below), or it never waited and finished
    else:
        raise AssertionError("the requests did not finish")
    return [results[r] for r in ids]


def _drain(*engines: EngineCore) -> None:
    """Step until no engine has work: held blocks must be released by then."""
    for _ in range(100_000):
        busy = [e for e in engines if e.has_work()]
        if not busy:
            return
        for engine in busy:
            _step(engine, {})
    raise AssertionError("engines still have work (a connector never reported a transfer finished)")


def _request(req_id: str, prompt: list[int], max_tokens: int, kv_params: Any) -> EngineCoreRequest:
    import time

    return EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, kv_transfer_params=kv_params
        ),
        arrival_time=time.monotonic(),
    )
