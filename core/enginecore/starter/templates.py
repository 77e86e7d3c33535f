"""The files ``enginecore plugin new`` writes, one set per plugin kind.

Placeholders (``string.Template``): ``$dist`` (distribution), ``$package`` (import
name), ``$entry_point`` (plugin name), ``$component`` (the name a config selects),
``$cls`` (the component class), ``$api`` (the plugin-API range), ``$hook``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    hook: str
    module: str  # the component's module inside the package
    class_suffix: str
    summary: str
    config_key: str  # flat config name that selects the component
    select_toml: str  # the engine.toml lines that select it
    component: str  # the component module's source
    test: str  # tests/test_<package>.py
    extra_tests: str = ""  # more test files (conftest) as "name\n---\nsource"


PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "$summary"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["enginecore>=0.1"]

[project.optional-dependencies]
test = ["pytest>=8"]

# The line that makes this a plugin: enginecore loads this module at start-up.
[project.entry-points.enginecore]
$entry_point = "$package.plugin"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
# enginecore's conformance kit (its fixtures) loads only when named.
addopts = "-p enginecore.testing"
"""

INIT = '''"""$summary (an enginecore plugin)."""

from $package.$module import $cls

__version__ = "0.1.0"
__all__ = ["$cls", "__version__"]
'''

PLUGIN = '''"""The module the ``enginecore`` entry point names: hook implementations only.

Keep it cheap to import: enginecore imports it in every process that builds registries.
The component is registered as a lazy "module:Class" string, imported only when a config
selects "$component".
"""

from __future__ import annotations

import enginecore


@enginecore.hookimpl
def plugin_api_versions() -> str:
    # The plugin-API versions this plugin was written and tested against: an enginecore
    # outside this range refuses to load it and says which version it needs.
    return "$api"


@enginecore.hookimpl
def $hook(registry) -> None:
    registry.add("$component", "$package.$module:$cls", summary="$summary")
'''

README = """# $dist

$summary. An [enginecore](https://pypi.org/project/enginecore/) plugin made with
`enginecore plugin new`.

## Install

```bash
pip install -e .
enginecore plugins --check      # lists "$entry_point  ($dist 0.1.0)" and validates it
```

## Use

$use_section

## Test

The tests run enginecore's conformance kit (`enginecore.testing`) against the plugin:

```bash
pip install -e '.[test]'
python -m pytest
```

## Layout

- `pyproject.toml`: the entry point `[project.entry-points.enginecore]`
  `$entry_point = "$package.plugin"`.
- `src/$package/plugin.py`: `plugin_api_versions()` and `$hook(registry)`.
- `src/$package/$module.py`: `$cls`, the component.
- `tests/`: the conformance suite subclassed for this plugin, and a check that the
  installed entry point provides "$component".
"""

ENTRY_POINT_TEST = '''

def test_the_installed_plugin_provides_$test_name():
    """The entry point is wired: enginecore finds the plugin and resolves "$component"."""
    host = enginecore.make_plugin_manager()
    record = host.records["$entry_point"]
    assert record.loaded, record.error
    assert record.distribution == "$dist"
    assert record.api_versions == "$api"
    assert host.registry("$registry_kind").get("$component") is $cls
'''

CONFIG_FILE_TEST = """

def test_a_config_file_selects_it(tmp_path):
    config_file = tmp_path / "engine.toml"
    config_file.write_text($select_toml_literal)
    config = enginecore.make_config(config_file)
    registry = enginecore.make_plugin_manager().registry("$registry_kind")
    assert registry.get($config_expr) is $cls
"""

POLICY = '''"""$cls: the order of the waiting queue, admission and preemption."""

from __future__ import annotations

from collections.abc import Sequence

from enginecore.interfaces import SchedulerState, SchedulingPolicy
from enginecore.request import Request


class $cls(SchedulingPolicy):
    """Shortest prompt first; replace the rule with yours.

    The built-in scheduler owns all state and calls these methods; chunked prefill,
    prefix caching and async scheduling keep working whatever they decide.
    """

    name = "$component"

    def sort_key(self, request: Request) -> tuple[int, int]:
        # The smallest key is admitted first. End with seq_no (arrival order) so equal
        # keys keep a deterministic order; never use wall-clock time.
        return (request.num_prompt_tokens, request.seq_no)

    def admit(self, request: Request, state: SchedulerState) -> bool:
        # May `request` (the next in order) start now? Admit everything by default.
        return True

    def pick_preemption_victim(self, running: Sequence[Request]) -> Request:
        # When the KV cache is full: preempt the request that sorts last.
        return max(running, key=self.sort_key)
'''

POLICY_TEST = (
    '''"""Tests of $cls: enginecore's conformance kit plus its own rule."""

from __future__ import annotations

import enginecore
from enginecore import SamplingParams
from enginecore.request import Request
from enginecore.testing import SchedulingPolicyContract

from $package import $cls


class Test${cls}Contract(SchedulingPolicyContract):
    """Runs the policy alone and inside the built-in scheduler (sync and async)."""

    policy = "$component"


def test_shorter_prompts_go_first():
    policy = $cls(enginecore.make_config())
    requests = [
        Request(f"r{n}", list(range(1, n + 1)), SamplingParams(), seq_no=i)
        for i, n in enumerate([30, 5, 12])
    ]
    assert [r.request_id for r in sorted(requests, key=policy.sort_key)] == ["r5", "r12", "r30"]
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

EXECUTOR = '''"""$cls: runs the one worker in this process, on a background thread.

An executor is the boundary between the scheduler and the ranks that run the model.
``collective_rpc`` is the one primitive; the Executor base class builds execute_model,
sample_tokens, determine_available_memory, ... on it. Start here and move the worker
somewhere else (a pod, a remote host) while keeping the contract the tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from enginecore.interfaces import Executor, WorkerSpec
from enginecore.registry import import_ref


class RankCallError(RuntimeError):
    """A call raised on a rank; the message names the rank, as the engine expects."""

    def __init__(self, rank: int, method: str, exc: BaseException) -> None:
        super().__init__(f"rank {rank} raised in {method}: {type(exc).__name__}: {exc}")
        self.rank = rank


class $cls(Executor):
    def __init__(self, config: Any, worker_spec: WorkerSpec) -> None:
        super().__init__(config, worker_spec)
        if config.parallel.world_size != 1:
            raise ValueError(
                f"executor '$component' runs one rank, but the config asks for "
                f"{config.parallel.world_size} (tensor_parallel_size * pipeline_parallel_size)"
            )
        # Two batches in flight let the engine schedule step N+1 while N computes.
        self.max_concurrent_batches = 2 if config.scheduler.async_scheduling else 1
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="$entry_point")
        worker_cls = import_ref(worker_spec.worker_ref)  # the generic enginecore Worker
        self.worker = worker_cls(config, worker_spec)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> list[Any] | Any | Future:
        if unique_reply_rank not in (None, 0):  # rank 0 is the only one: it must be asked
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is outside world size 1")
        fn = self.worker.resolve_method(method)  # an unknown name fails here, by name
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))

        def call() -> Any:
            try:
                result = fn(*args, **(kwargs or {}))
            except Exception as exc:
                raise RankCallError(self.worker.rank, name, exc) from exc
            # One result per rank, in rank order -- or only the asked rank's result.
            return result if unique_reply_rank is not None else [result]

        # Every call goes through the one thread, so calls apply in order.
        future = self._calls.submit(call)
        if non_block:
            return future
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"collective_rpc {name!r} timed out after {timeout} s") from None

    def shutdown(self) -> None:
        self._calls.shutdown(wait=True, cancel_futures=True)
        shutdown = getattr(self.worker, "shutdown", None)
        if shutdown is not None:
            shutdown()
'''

EXECUTOR_TEST = (
    '''"""Tests of $cls: enginecore's conformance kit and a real engine on it."""

from __future__ import annotations

import enginecore
from enginecore import SamplingParams
from enginecore.testing import ExecutorContract

from $package import $cls


class Test${cls}Contract(ExecutorContract):
    executor = "$component"  # selected by name, as a config would
    world_size = 1


def test_an_engine_generates_on_it(enginecore_llm):
    """enginecore_llm (a fixture of the kit) runs a tiny model with this executor,
    selected by enginecore_config_overrides in conftest.py."""
    out = enginecore_llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

EXECUTOR_CONFTEST = '''conftest.py
---
import pytest


@pytest.fixture(scope="module")
def enginecore_config_overrides():
    """Config (flat names) for the enginecore_* fixtures: run them on this executor."""
    return {"executor": "$component", "multiprocessing": False}
'''

STAT_LOGGER = '''"""$cls: receives each engine step's statistics in the frontend."""

from __future__ import annotations

import logging
import threading
from typing import Any

from enginecore.interfaces import IterationStats, StatLogger

logger = logging.getLogger("$package")


class $cls(StatLogger):
    """Counts prompt and generated tokens and finished requests; ``log()`` (called every
    ``observability.log_stats_interval`` seconds) writes one summary line."""

    def __init__(self, config: Any, engine_index: int = 0) -> None:
        super().__init__(config, engine_index)
        self._lock = threading.Lock()  # record() and log() may run on different threads
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_requests = 0

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        # Called once per engine step; keep it cheap and never change the stats.
        if iteration_stats is None:
            return
        with self._lock:
            self.prompt_tokens += iteration_stats.num_prompt_tokens
            self.generation_tokens += iteration_stats.num_generation_tokens
            self.finished_requests += len(iteration_stats.finished_requests)

    def log(self) -> None:
        with self._lock:
            counts = (self.prompt_tokens, self.generation_tokens, self.finished_requests)
        logger.info(
            "engine %d: %d prompt tokens, %d generated tokens, %d requests finished",
            self.engine_index,
            *counts,
        )
'''

STAT_LOGGER_TEST = (
    '''"""Tests of $cls: enginecore's conformance kit plus its own counting."""

from __future__ import annotations

import enginecore
from enginecore.interfaces import IterationStats
from enginecore.testing import StatLoggerContract

from $package import $cls


class Test${cls}Contract(StatLoggerContract):
    stat_logger = "$component"


def test_counts_tokens_and_finished_requests():
    stats = $cls(enginecore.make_config(), 0)
    stats.record(None, IterationStats(num_prompt_tokens=12, num_generation_tokens=2))
    stats.record(None, IterationStats(num_generation_tokens=1, finished_requests=[object()]))
    stats.record(None, None)
    assert (stats.prompt_tokens, stats.generation_tokens, stats.finished_requests) == (12, 3, 1)
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

KV_CONNECTOR = '''"""$cls: a KV connector in two halves joined by one per-step metadata object.

The scheduler half (engine-core process) decides which prompt blocks to load or save;
the worker half (inside each rank's forward pass) moves the bytes. This starter keeps
every full prompt block it computes as one file under ``kv_transfer.extra_config.path``,
named by a hash of the prompt prefix up to that block, and loads the longest run of
saved blocks that prefixes a new prompt, so a second engine on the same directory
computes only the rest. Loads and saves are synchronous (in the forward pass); replace
``BlockStore`` to keep blocks elsewhere. Built only on ``enginecore.interfaces``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from enginecore.interfaces import KVConnectorFactory, KVConnectorScheduler, KVConnectorWorker


def block_keys(token_ids: list[int], block_size: int, salt: str | None) -> list[str]:
    """One key per full block: a SHA-256 chain, so equal keys mean equal prefixes."""
    keys, parent = [], hashlib.sha256((salt or "").encode()).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = ",".join(map(str, token_ids[start : start + block_size])).encode()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent.hex())
    return keys


class BlockStore:
    """Blocks as files, one directory per model and cache shape (blocks of another
    model or dtype are never found), one file per rank's shard of a block."""

    def __init__(self, config: Any) -> None:
        path = config.kv_transfer.extra_config.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError('$component needs kv_transfer.extra_config.path (a directory)')
        par = config.parallel
        shape = [config.model.path, config.model.dtype, config.cache.tokens_per_block]
        shape += [par.tensor_parallel_size, par.pipeline_parallel_size]
        namespace = hashlib.sha256(repr(shape).encode()).hexdigest()[:16]
        self.root = Path(path).expanduser() / namespace
        self.root.mkdir(parents=True, exist_ok=True)
        self.world_size = par.world_size

    def path(self, key: str, rank: int) -> Path:
        return self.root / f"{key}.rank{rank}.pt"

    def has(self, key: str) -> bool:
        return all(self.path(key, rank).is_file() for rank in range(self.world_size))

    def write(self, key: str, block: torch.Tensor, rank: int) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            torch.save(block, f)
        os.replace(tmp, self.path(key, rank))  # readers see the whole file or none

    def read(self, key: str, rank: int) -> torch.Tensor:
        block: torch.Tensor = torch.load(self.path(key, rank), weights_only=True)
        return block


@dataclass
class ${cls}Metadata:
    """What the worker half does this step: request id -> (cache block ids, keys)."""

    loads: dict[str, tuple[list[int], list[str]]] = field(default_factory=dict)
    saves: dict[str, tuple[list[int], list[str]]] = field(default_factory=dict)

    @property
    def load_request_ids(self) -> set[str]:  # a failed load fails only these requests
        return set(self.loads)

    @property
    def save_request_ids(self) -> set[str]:
        return set(self.saves)


@dataclass
class _Tracked:
    keys: list[str]  # the prompt's full blocks
    block_ids: list[int]
    num_saved: int = 0  # leading blocks saved (or found saved)


class ${cls}Scheduler(KVConnectorScheduler):
    """Engine-core side: which blocks the store holds, and what to load and save."""

    def __init__(self, config: Any) -> None:
        self.block_size = config.cache.tokens_per_block
        self.loads_enabled = config.kv_transfer.role != "kv_producer"
        self.saves_enabled = config.kv_transfer.role != "kv_consumer"
        self.store = BlockStore(config)
        self.tracked: dict[str, _Tracked] = {}
        self.pending_loads: dict[str, tuple[list[int], list[str]]] = {}
        self.saving: set[str] = set()  # requests with saves issued: their blocks are held

    def _keys(self, request: Any) -> list[str]:
        return block_keys(request.prompt_token_ids, self.block_size, request.cache_salt)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.loads_enabled:
            return 0, False
        # The prompt's last token is always computed: never match the block holding it.
        usable = (request.num_prompt_tokens - 1) // self.block_size
        found = 0
        for key in self._keys(request)[:usable]:
            if not self.store.has(key):
                break
            found += 1
        external = found * self.block_size - num_computed_tokens
        return (external, False) if external > 0 else (0, False)  # loaded in the forward

    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        keys = self._keys(request)
        self.tracked[request.request_id] = _Tracked(keys, list(block_ids))
        if num_external_tokens:
            first = request.num_computed_tokens // self.block_size
            last = (request.num_computed_tokens + num_external_tokens) // self.block_size
            self.pending_loads[request.request_id] = (
                list(block_ids[first:last]),
                keys[first:last],
            )

    def build_connector_meta(self, scheduler_output: Any) -> ${cls}Metadata:
        so = scheduler_output
        computed_after: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            if new.req_id in self.tracked:
                self.tracked[new.req_id].block_ids = list(new.block_ids)
                computed_after[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self.tracked:
                continue
            if i < len(cached.new_block_ids) and cached.new_block_ids[i]:
                self.tracked[req_id].block_ids.extend(cached.new_block_ids[i])
            computed_after[req_id] = cached.num_computed_tokens[i]
        meta = ${cls}Metadata(loads=self.pending_loads)
        self.pending_loads = {}
        for req_id, before in computed_after.items():
            done = before + so.num_scheduled_tokens.get(req_id, 0)
            save = self._due(req_id, done) if self.saves_enabled else None
            if save is not None:
                meta.saves[req_id] = save
                self.saving.add(req_id)
        return meta

    def _due(self, req_id: str, num_computed: int) -> tuple[list[int], list[str]] | None:
        """The full prompt blocks this step completes that the store lacks."""
        tracked = self.tracked[req_id]
        num_full = min(num_computed // self.block_size, len(tracked.keys))
        due = [
            (tracked.block_ids[i], tracked.keys[i])
            for i in range(tracked.num_saved, num_full)
            if not self.store.has(tracked.keys[i])
        ]
        tracked.num_saved = max(tracked.num_saved, num_full)
        return ([b for b, _ in due], [k for _, k in due]) if due else None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.tracked.pop(request.request_id, None)
        self.pending_loads.pop(request.request_id, None)
        if request.request_id in self.saving:
            # A step saved from its blocks: held until the worker reports the save done.
            self.saving.discard(request.request_id)
            return True, None
        return False, None


class ${cls}Worker(KVConnectorWorker):
    """Worker side: copies blocks between the paged cache and the store. Each layer's
    cache is ``[2, num_blocks, block_size, kv_heads, head_dim]``; a stored block is this
    rank's ``[layers, 2, block_size, kv_heads, head_dim]``."""

    def __init__(self, config: Any, rank: int) -> None:
        self.rank = rank
        self.store = BlockStore(config)
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self.staged: dict[int, torch.Tensor] = {}  # layer -> [2, n, block_size, h, d]
        self.saves: dict[str, tuple[list[int], list[str]]] = {}
        self.saved: set[str] = set()  # requests with saves written, until reported
        self.invalid: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = list(kv_caches.values())
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self, metadata: ${cls}Metadata | None) -> None:
        if metadata is None:
            return
        for block_ids, keys in metadata.loads.values():
            for block_id, key in zip(block_ids, keys, strict=True):
                try:
                    block = self.store.read(key, self.rank)
                except (OSError, RuntimeError):  # gone or unreadable: recomputed
                    self.invalid.add(block_id)
                    continue
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, block_id] = block[layer].to(cache.device, cache.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv loaded every layer before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, metadata: ${cls}Metadata | None
    ) -> None:
        if metadata is None or not metadata.saves:
            return
        self.saves = metadata.saves
        ids = [b for block_ids, _ in metadata.saves.values() for b in block_ids]
        index = torch.tensor(ids, dtype=torch.int64, device=kv_layer.device)
        # Copied now: the cache blocks may be reused once the request is freed.
        self.staged[self.layer_index[layer_name]] = kv_layer.index_select(1, index).cpu()

    def wait_for_save(self) -> None:
        if not self.staged:
            return
        staged, self.staged = self.staged, {}
        layers = torch.stack([staged[i] for i in range(len(staged))])  # [L, 2, n, bs, h, d]
        offset = 0
        for req_id, (_, keys) in self.saves.items():
            for key in keys:
                self.store.write(key, layers[:, :, offset].clone(), self.rank)
                offset += 1
            self.saved.add(req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done_sending = finished_req_ids & self.saved
        self.saved -= done_sending
        return done_sending, set()  # loads are synchronous: nothing to report

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid


class $cls(KVConnectorFactory):
    """What the registry holds: builds each half where it runs."""

    def scheduler_side(self, config: Any) -> ${cls}Scheduler:
        return ${cls}Scheduler(config)

    def worker_side(self, config: Any, rank: int) -> ${cls}Worker:
        return ${cls}Worker(config, rank)
'''

KV_CONNECTOR_TEST = (
    '''"""Tests of $cls: enginecore's conformance kit plus its own halves."""

from __future__ import annotations

import enginecore
from enginecore.interfaces import KVConnectorScheduler, KVConnectorWorker
from enginecore.testing import KVConnectorContract

from $package import $cls


class Test${cls}Contract(KVConnectorContract):
    connector = "$component"

    def producer_kv_transfer(self, tmp_path):
        return {"connector": "$component", "extra_config": {"path": str(tmp_path / "kv")}}


def test_builds_both_halves(tmp_path):
    config = enginecore.make_config(
        kv_transfer={"connector": "$component", "extra_config": {"path": str(tmp_path)}}
    )
    connector = $cls()
    assert isinstance(connector.scheduler_side(config), KVConnectorScheduler)
    worker = connector.worker_side(config, 0)
    assert isinstance(worker, KVConnectorWorker)
    assert worker.get_finished(set()) == (set(), set())
'''
    + ENTRY_POINT_TEST
    + CONFIG_FILE_TEST
)

MODEL = '''"""$cls: a model architecture, registered under its Hugging Face name.

A Llama-shaped decoder (the checkpoint's config.json says "architectures": ["$cls"])
built only from ``enginecore.layers``: attention runs on whichever attention backend
the engine selects and every projection through the selected linear method, so the
model works on every device and weight format the installed plugins provide. Change
the blocks to your architecture; keep the constructor ``(hf_config, parallel, dtype)``,
``forward(input_ids, positions, kv_caches, attn_context, hidden_states=None)``,
``compute_logits`` and ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from enginecore.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    load_params,
    rope_parameters,
    vocab_parallel_logits,
)


class Block(nn.Module):
    def __init__(self, cfg: Any, parallel: Any, dtype: torch.dtype) -> None:
        super().__init__()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            heads,
            kv_heads,
            bias=False,
            parallel=parallel,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, cfg.hidden_size, bias=False, parallel=parallel, dtype=dtype
        )
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
        )
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], bias=False, parallel=parallel, dtype=dtype, gated=True
        )
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, bias=False, parallel=parallel, dtype=dtype
        )
        self.act = SiluAndMul()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, rotary, kv_cache, ctx):
        t, a = hidden.shape[0], self.attn
        qkv = self.qkv_proj(self.input_layernorm(hidden))
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qk = qkv[:, : q_size + kv_size].view(t, a.num_heads + a.num_kv_heads, a.head_dim)
        qk = rotary(positions, qk)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
        v = qkv[:, q_size + kv_size :].reshape(t, a.num_kv_heads, a.head_dim)
        out = self.attn(q, k, v, kv_cache, ctx).reshape(t, a.num_heads * a.head_dim)
        hidden = hidden + self.o_proj(out)
        x = self.post_attention_layernorm(hidden)
        fused = self.gate_up_proj.fused_silu_and_mul(x)
        mlp = self.down_proj(fused if fused is not None else self.act(self.gate_up_proj(x)))
        return hidden + mlp


class $cls(nn.Module):
    # checkpoint projection -> (fused parameter, shard)
    stacked_params = {
        "self_attn.q_proj": ("qkv_proj", "q"),
        "self_attn.k_proj": ("qkv_proj", "k"),
        "self_attn.v_proj": ("qkv_proj", "v"),
        "self_attn.o_proj": ("o_proj", None),
        "mlp.gate_proj": ("gate_up_proj", 0),
        "mlp.up_proj": ("gate_up_proj", 1),
        "mlp.down_proj": ("down_proj", None),
    }

    def __init__(self, hf_config: Any, parallel: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if parallel.pp_size > 1:
            raise NotImplementedError("$cls does not support pipeline parallelism")
        cfg = hf_config
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype
        )
        self.layers = nn.ModuleList(Block(cfg, parallel, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(
            self.layers[0].head_dim, cfg.max_position_embeddings, rope_parameters(cfg)
        )
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None
        if not self.tied:
            self.lm_head = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, parallel=parallel, dtype=dtype
            )

    def forward(self, input_ids, positions, kv_caches, attn_context, hidden_states=None):
        hidden = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            cache = kv_caches[i] if kv_caches else None
            hidden = layer(positions, hidden, self.rotary, cache, attn_context)
        return self.norm(hidden)

    def logits_head(self) -> VocabParallelEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden_states, self.logits_head())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> tuple[str, Any] | None:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tied):
                return None
            name = name.removeprefix("model.")
            for ckpt, (fused, shard) in self.stacked_params.items():
                if f".{ckpt}." in name:
                    return name.replace(f".{ckpt}.", f".{fused}."), shard
            return name, None

        load_params(self, weights, rename)
'''


MODEL_TEST = (
    '''"""Tests of $cls: enginecore's model-runner conformance kit with this model."""

from __future__ import annotations

import enginecore
from enginecore.testing import ModelRunnerContract

from $package import $cls


class Test${cls}Contract(ModelRunnerContract):
    """A tiny random Llama-shaped checkpoint relabelled "$cls", run by the torch runner
    and compared token for token with transformers."""

    runner = "torch"
    architecture = "$component"
'''
    + ENTRY_POINT_TEST
)

from enginecore.starter.backend_templates import (  # noqa: E402 (they follow the shared parts)
    ATTENTION_BACKEND,
    ATTENTION_BACKEND_TEST,
    LINEAR_METHOD,
    LINEAR_METHOD_TEST,
)

KINDS: dict[str, Kind] = {
    "scheduler-policy": Kind(
        hook="register_scheduling_policies",
        module="policy",
        class_suffix="Policy",
        summary="a scheduling policy for enginecore",
        config_key="scheduling_policy",
        select_toml='[scheduler]\npolicy = "$component"\n',
        component=POLICY,
        test=POLICY_TEST,
    ),
    "executor": Kind(
        hook="register_executors",
        module="executor",
        class_suffix="Executor",
        summary="an executor for enginecore",
        config_key="executor",
        select_toml='[parallel]\nexecutor = "$component"\n',
        component=EXECUTOR,
        test=EXECUTOR_TEST,
        extra_tests=EXECUTOR_CONFTEST,
    ),
    "stat-logger": Kind(
        hook="register_stat_loggers",
        module="logger",
        class_suffix="StatLogger",
        summary="a stat logger for enginecore",
        config_key="stat_loggers",
        select_toml='[observability]\nstat_loggers = ["logging", "$component"]\n',
        component=STAT_LOGGER,
        test=STAT_LOGGER_TEST,
    ),
    "kv-connector": Kind(
        hook="register_kv_connectors",
        module="connector",
        class_suffix="Connector",
        summary="a KV connector for enginecore",
        config_key="kv_connector",
        select_toml='[kv_transfer]\nconnector = "$component"\n'
        'extra_config = { path = "$component-kv" }\n',
        component=KV_CONNECTOR,
        test=KV_CONNECTOR_TEST,
    ),
    "attention-backend": Kind(
        hook="register_attention_backends",
        module="backend",
        class_suffix="AttentionBackend",
        summary="an attention backend for enginecore",
        config_key="attention_backend",
        select_toml='[model]\nattention_backend = "$component"\n',
        component=ATTENTION_BACKEND,
        test=ATTENTION_BACKEND_TEST + ENTRY_POINT_TEST + CONFIG_FILE_TEST,
    ),
    "linear-method": Kind(
        hook="register_linear_methods",
        module="linear",
        class_suffix="LinearMethod",
        summary="a linear method for enginecore",
        config_key="linear_method",
        select_toml='[model]\nlinear_method = "$component"\n',
        component=LINEAR_METHOD,
        test=LINEAR_METHOD_TEST + ENTRY_POINT_TEST + CONFIG_FILE_TEST,
    ),
    "model": Kind(
        hook="register_models",
        module="model",
        class_suffix="ForCausalLM",
        summary="a model architecture for enginecore",
        config_key="model",
        select_toml="# the checkpoint's config.json names the architecture:\n"
        '# "architectures": ["$component"]\n',
        component=MODEL,
        test=MODEL_TEST,
    ),
}

# The parser kinds live in their own module (it imports the shared pieces above).
from enginecore.starter.parser_templates import PARSER_KINDS  # noqa: E402

KINDS.update(PARSER_KINDS)
