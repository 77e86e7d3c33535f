"""One ``test_hook_<name>`` per hook in ``enginecore.hookspecs`` (``test_docs`` checks this).

Each test registers an in-process plugin object on a real :class:`PluginHost` and drives
the hook through the same path the engine uses: ``host.registry(kind)`` for
registration hooks, the host's typed methods for lifecycle hooks, and a config naming
the component where the config has a key for it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

import enginecore
from enginecore import SamplingParams, make_config
from enginecore.errors import IncompatiblePluginError, PluginLoadError, UnknownComponentError
from enginecore.interfaces import (
    Executor,
    IterationStats,
    KVConnectorScheduler,
    KVConnectorWorker,
    ModelRunner,
    SchedulingPolicy,
    SpecDecodeProposer,
    StatLogger,
    WorkerSpec,
)
from enginecore.metrics.stats import FinishedRequestStats
from enginecore.plugins import make_plugin_manager
from enginecore.protocol import SchedulerStats
from enginecore.request import FinishReason, Request
from enginecore_models.models.llama import LlamaForCausalLM
from tests.helpers.plugin_host import bare_host, registering


@pytest.fixture(autouse=True)
def clean_plugin_env(monkeypatch):
    for name in (
        "ENGINECORE_PLUGINS",
        "ENGINECORE_DISABLE_PLUGINS",
        "ENGINECORE_STRICT_PLUGINS",
        "ENGINECORE_TRACE_PLUGINS",
    ):
        monkeypatch.delenv(name, raising=False)


# --- 0. compatibility -------------------------------------------------------------------


def test_hook_plugin_api_versions():
    class Compatible:
        @enginecore.hookimpl
        def plugin_api_versions(self):
            return ">=1.0,<2"

    class TooNew:
        @enginecore.hookimpl
        def plugin_api_versions(self):
            return ">=3"

    host = bare_host(("compatible", Compatible()))
    assert host.records["compatible"].api_versions == ">=1.0,<2"
    assert host.pm.hook.plugin_api_versions() == ">=1.0,<2"  # firstresult: one answer

    record = host.register_object(TooNew(), "too_new")
    assert not record.loaded
    assert "supports plugin API >=3" in record.error
    assert f"provides plugin API {enginecore.PLUGIN_API_VERSION}" in record.error
    assert host.pm.get_plugin("too_new") is None


def test_hook_plugin_api_versions_rejects_a_malformed_range(monkeypatch):
    class Garbled:
        @enginecore.hookimpl
        def plugin_api_versions(self):
            return "one point oh"

    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    host = make_plugin_manager(load_entrypoints=False, builtins={})
    with pytest.raises(PluginLoadError, match="not a version specifier") as info:
        host.register_object(Garbled(), "garbled")
    assert isinstance(info.value.__cause__, IncompatiblePluginError)


# --- 1. component registration ----------------------------------------------------------


def test_hook_register_schedulers():
    class ToyScheduler:
        pass

    host = bare_host(
        ("toy", registering("register_schedulers", "toy", ToyScheduler, "a toy scheduler"))
    )
    config = make_config(scheduler_name="toy")
    registry = host.registry("scheduler")
    assert registry.get(config.scheduler.name) is ToyScheduler
    assert registry.entry("toy").summary == "a toy scheduler"
    assert host.records["toy"].registered == {"scheduler": ["toy"]}


class LowestPriorityFirst(SchedulingPolicy):
    def sort_key(self, request: Request) -> Any:
        return (request.priority, request.seq_no)


def test_hook_register_scheduling_policies():
    host = bare_host(
        ("prio", registering("register_scheduling_policies", "lowest", LowestPriorityFirst))
    )
    config = make_config(scheduling_policy="lowest")
    policy = host.registry("scheduling_policy").get(config.scheduler.policy)(config)
    requests = [
        Request("a", [1], SamplingParams(), seq_no=0, priority=5),
        Request("b", [1], SamplingParams(), seq_no=1, priority=1),
        Request("c", [1], SamplingParams(), seq_no=2, priority=1),
    ]
    assert [r.request_id for r in sorted(requests, key=policy.sort_key)] == ["b", "c", "a"]
    assert policy.pick_preemption_victim(requests).request_id == "a"


class EchoExecutor(Executor):
    def collective_rpc(self, method, args=(), kwargs=None, non_block=False, **_: Any):
        return [(method, args)]

    def shutdown(self) -> None:
        """Nothing to stop: it runs no ranks."""


def test_hook_register_executors():
    host = bare_host(("echo", registering("register_executors", "echo", EchoExecutor)))
    config = make_config(executor="echo")
    cls = host.registry("executor").get(config.parallel.executor)
    executor = cls(config, WorkerSpec(worker_ref="w:W", model_runner_ref="r:R", model_refs={}))
    assert executor.initialize_cache(8) is None
    assert executor.get_max_model_len() == [("get_max_model_len", ())]


class NullRunner(ModelRunner):
    def load_model(self) -> None: ...
    def determine_available_memory(self) -> int:
        return 1 << 20

    def get_kv_cache_block_bytes(self) -> int:
        return 1024

    def get_max_model_len(self) -> int:
        return 64

    def initialize_kv_cache(self, num_blocks: int) -> None: ...
    def execute_model(self, scheduler_output):
        return None

    def sample_tokens(self, grammar_output):
        raise NotImplementedError


def test_hook_register_model_runners():
    host = bare_host(
        ("null", registering("register_model_runners", "null", f"{__name__}:NullRunner"))
    )
    config = make_config(runner="null")
    registry = host.registry("model_runner")
    assert registry.entry("null").factory == f"{__name__}:NullRunner"  # lazy until selected
    runner = registry.get(config.model.runner)()
    assert runner.determine_available_memory() // runner.get_kv_cache_block_bytes() == 1024


class ToyForCausalLM(LlamaForCausalLM):
    """A plugin's architecture: records how the runner called its factory."""

    built: list = []

    def __init__(self, hf_config, parallel, dtype):
        type(self).built.append((type(hf_config).__name__, parallel.tp_size, dtype))
        super().__init__(hf_config, parallel, dtype)


def test_hook_register_models(tiny_llama):
    """A model registered by a plugin is built the way the runner builds it:
    ``factory(hf_config, parallel, dtype)``."""
    import torch

    from enginecore.engine.components import resolve_components
    from enginecore_models.model_runner import TorchModelRunner

    host = make_plugin_manager(load_entrypoints=False)
    plugin = registering("register_models", "LlamaForCausalLM", ToyForCausalLM, override=True)
    host.register_object(plugin, "toy_arch")
    config = make_config(model=str(tiny_llama), dtype="float32")
    runner = TorchModelRunner(config, resolve_components(config, host).worker_spec)
    runner.load_model()
    assert ToyForCausalLM.built == [("LlamaConfig", 1, torch.float32)]
    assert isinstance(runner.model, ToyForCausalLM)


class NoopConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens): ...
    def build_connector_meta(self, scheduler_output):
        return {"step": "meta"}

    def request_finished(self, request, block_ids):
        return False, None


class NoopConnectorWorker(KVConnectorWorker):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def start_load_kv(self, metadata): ...
    def wait_for_layer_load(self, layer_name): ...
    def save_kv_layer(self, layer_name, kv_layer, metadata): ...
    def wait_for_save(self): ...
    def get_finished(self, finished_req_ids):
        return set(), set(finished_req_ids)


class NoopConnector:
    def scheduler_side(self, config):
        return NoopConnectorScheduler()

    def worker_side(self, config, rank):
        return NoopConnectorWorker(rank)


def test_hook_register_kv_connectors():
    host = bare_host(("noop_kv", registering("register_kv_connectors", "noop", NoopConnector)))
    config = make_config(kv_connector="noop")
    connector = host.registry("kv_connector").get(config.kv_transfer.connector)()
    scheduler_half = connector.scheduler_side(config)
    worker_half = connector.worker_side(config, rank=1)
    assert isinstance(scheduler_half, KVConnectorScheduler)
    assert isinstance(worker_half, KVConnectorWorker) and worker_half.rank == 1
    meta = scheduler_half.build_connector_meta(None)
    assert worker_half.start_load_kv(meta) is None
    assert worker_half.get_finished({"r1"}) == (set(), {"r1"})


class CountingStatLogger(StatLogger):
    def __init__(self, config, engine_index=0):
        super().__init__(config, engine_index)
        self.steps = 0

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        self.steps += 1


def test_hook_register_stat_loggers():
    host = make_plugin_manager(
        load_entrypoints=False, builtins={"builtin_stat_loggers": "enginecore_stat_loggers.plugin"}
    )
    host.register_object(
        registering("register_stat_loggers", "counting", CountingStatLogger), "counting"
    )
    registry = host.registry("stat_logger")
    assert {n: registry.entry(n).plugin for n in registry} == {
        "logging": "builtin_stat_loggers",
        "prometheus": "builtin_stat_loggers",
        "counting": "counting",
    }
    config = make_config(stat_loggers=["logging", "counting"])
    loggers = [registry.get(name)(config, 0) for name in config.observability.stat_loggers]
    for logger in loggers:
        logger.record(SchedulerStats(num_running_reqs=1), IterationStats(num_prompt_tokens=4))
    assert type(loggers[0]).__name__ == "LoggingStatLogger"
    assert loggers[0].num_prompt_tokens == 4
    assert loggers[1].steps == 1


def test_hook_register_worker_rpcs():
    def report_rank(worker, offset=0):
        return worker.rank + offset

    host = bare_host(("rpcs", registering("register_worker_rpcs", "report_rank", report_rank)))
    fn = host.registry("worker_rpc").get("report_rank")
    workers = [type("FakeWorker", (), {"rank": r})() for r in range(2)]
    assert [fn(w, offset=10) for w in workers] == [10, 11]


def test_hook_register_structured_output_backends(tiny_llama):
    from enginecore.interfaces import StructuredOutputBackend
    from enginecore.structured_output import StructuredOutputManager
    from tests.helpers.token_trie_backend import TokenTrieBackend, TokenTriePlugin

    host = bare_host(("token-trie", TokenTriePlugin()))
    config = make_config(model=str(tiny_llama), structured_output_backend="token_trie")
    backend_cls = host.registry("structured_output_backend").get("token_trie")
    assert backend_cls is TokenTrieBackend and issubclass(backend_cls, StructuredOutputBackend)
    # The engine's manager selects it by config and names the plugin that provides it.
    manager = StructuredOutputManager(config, host)
    assert manager.backend_provider == "token-trie"
    manager.shutdown()
    # (tests/decoding/test_structured_output.py runs it in an engine.)


class RepeatLastToken(SpecDecodeProposer):
    """Guesses that the last token repeats (importable by reference, as workers need)."""

    def propose(self, token_ids, max_num_drafts):
        return [int(token_ids[-1])] * max_num_drafts


def test_hook_register_spec_decode_proposers():
    from enginecore.engine.components import resolve_components
    from enginecore_models.drafter import Drafter, TokenBuffer

    host = make_plugin_manager(load_entrypoints=False)
    host.register_object(
        registering("register_spec_decode_proposers", "repeat", RepeatLastToken), "repeat"
    )
    config = make_config(speculative_method="repeat", num_speculative_tokens=3)
    components = resolve_components(config, host)
    assert components.providers["spec_decode_proposer"] == "repeat (from repeat)"
    # Workers import the proposer from the reference the engine resolved.
    drafter = Drafter(config, components.worker_spec.spec_decode_proposer_ref)
    assert isinstance(drafter.proposer, RepeatLastToken)
    assert drafter.propose(TokenBuffer(), [5, 6, 7], vocab_size=100) == [7, 7, 7]
    with pytest.raises(UnknownComponentError, match="ngram"):
        resolve_components(make_config(speculative_method="nope", num_speculative_tokens=1), host)


# --- 2. lifecycle observers ---------------------------------------------------------------


class Recorder:
    """Implements every lifecycle hook and records its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @enginecore.hookimpl
    def engine_started(self, config, info):
        self.calls.append(("engine_started", (config, info)))

    @enginecore.hookimpl
    def worker_started(self, worker):
        self.calls.append(("worker_started", worker))

    @enginecore.hookimpl
    def request_finished(self, request_stats):
        self.calls.append(("request_finished", request_stats))

    @enginecore.hookimpl
    def engine_stopped(self, reason):
        self.calls.append(("engine_stopped", reason))


class Raiser:
    """Implements every lifecycle hook and always raises."""

    @enginecore.hookimpl(tryfirst=True)
    def engine_started(self, config, info):
        raise RuntimeError("observer bug in engine_started")

    @enginecore.hookimpl(tryfirst=True)
    def worker_started(self, worker):
        raise RuntimeError("observer bug in worker_started")

    @enginecore.hookimpl(tryfirst=True)
    def request_finished(self, request_stats):
        raise RuntimeError("observer bug in request_finished")

    @enginecore.hookimpl(tryfirst=True)
    def engine_stopped(self, reason):
        raise RuntimeError("observer bug in engine_stopped")


@pytest.fixture
def observers(caplog):
    """A recorder plus a raising observer that pluggy calls first."""
    caplog.set_level(logging.ERROR, logger="enginecore.plugins")
    recorder = Recorder()
    host = bare_host(("raiser", Raiser()), ("recorder", recorder))
    return host, recorder


def assert_raiser_logged(caplog, hook_name: str) -> None:
    assert f"plugin 'raiser' raised in {hook_name} (ignored)" in caplog.text
    assert f"observer bug in {hook_name}" in caplog.text  # the traceback is kept


def test_hook_engine_started(observers, caplog):
    host, recorder = observers
    config = make_config(max_num_seqs=4)
    info = {
        "max_model_len": 128,
        "num_blocks": 64,
        "block_size": 16,
        "components": {"scheduler": "default"},
    }
    host.engine_started(config, info)
    assert recorder.calls == [("engine_started", (config, info))]
    assert_raiser_logged(caplog, "engine_started")


def test_hook_worker_started(observers, caplog):
    host, recorder = observers
    worker = type("FakeWorker", (), {"rank": 3})()
    host.worker_started(worker)
    assert recorder.calls == [("worker_started", worker)]
    assert_raiser_logged(caplog, "worker_started")


def test_hook_request_finished(observers, caplog):
    host, recorder = observers
    stats = FinishedRequestStats(
        request_id="req-7",
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=5,
        num_generation_tokens=16,
        extra={"tenant": "blue"},
    )
    host.request_finished(stats)
    [(name, received)] = recorder.calls
    assert name == "request_finished" and received is stats
    assert received.finish_reason == "length" and received.extra == {"tenant": "blue"}
    assert_raiser_logged(caplog, "request_finished")


def test_hook_engine_stopped(observers, caplog):
    host, recorder = observers
    host.engine_stopped("shutdown")
    host.engine_stopped("EngineDeadError: worker rank 1 died")
    assert recorder.calls == [
        ("engine_stopped", "shutdown"),
        ("engine_stopped", "EngineDeadError: worker rank 1 died"),
    ]
    assert_raiser_logged(caplog, "engine_stopped")


def test_lifecycle_hooks_without_observers_are_no_ops():
    host = bare_host()
    assert not host.has_impls("engine_started")
    host.engine_started(make_config(), {})
    host.engine_stopped("shutdown")  # nothing registered: nothing raised


def test_a_raising_registration_hook_only_drops_its_own_plugin(monkeypatch):
    class Exploding:
        @enginecore.hookimpl
        def register_executors(self, registry):
            registry.add("half", EchoExecutor)
            raise ValueError("config file missing")

    host = bare_host(("ok", registering("register_executors", "echo", EchoExecutor)))
    host.register_object(Exploding(), "exploding")
    registry = host.registry("executor")
    assert list(registry) == ["echo"]  # "half" was rolled back
    assert "raised in register_executors: ValueError: config file missing" in (
        host.records["exploding"].error
    )
    monkeypatch.setenv("ENGINECORE_STRICT_PLUGINS", "1")
    strict = make_plugin_manager(load_entrypoints=False, builtins={})
    strict.register_object(Exploding(), "exploding")
    with pytest.raises(PluginLoadError, match="config file missing"):
        strict.registry("executor")
