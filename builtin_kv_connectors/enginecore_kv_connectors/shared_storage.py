"""``shared_storage``: KV blocks of computed prompt prefixes in a directory, shared by engines.

Every full prompt block an engine computes is saved as one file named by its prefix key
(a SHA-256 chain over the tokens, see :func:`prefix_keys`) under
``<path>/<model namespace>/``. Another engine on the same directory (another process,
another machine on a shared file system) finds the longest run of saved blocks that
prefixes a new prompt, loads them into its cache and computes only the tail.

Config: ``kv_transfer = {connector = "shared_storage", extra_config = {path = "DIR"}}``.
``role`` ``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does both.

Loads are asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS`` while a
background thread reads and checks the files); saves copy the blocks out of the cache
during the forward pass and a background thread writes them (atomically: temp file,
then rename). A request whose blocks are still being written keeps them until the
writes end (``delay_free``). Files are checked (layout, size, SHA-256) before use; a bad
one is deleted and its blocks recomputed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from enginecore.config import EngineConfig
from enginecore.errors import ConfigError
from enginecore.interfaces import KVConnectorFactory, KVConnectorScheduler, KVConnectorWorker
from enginecore.request import Request
from enginecore.runner_output import KVConnectorOutput
from enginecore.scheduler_output import SchedulerOutput
from enginecore_kv_connectors.kv_blocks import (
    InvalidBlockError,
    KVLayout,
    decode_block,
    encode_block,
    model_namespace,
    prefix_keys,
    scatter_blocks,
)

logger = logging.getLogger(__name__)

NAME = "shared_storage"


class BlockJob(msgspec.Struct, array_like=True):
    """Blocks of one request to load or save: cache block ids and their prefix keys."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


class SharedStorageMetadata(msgspec.Struct, kw_only=True):
    loads: list[BlockJob] = []
    saves: list[BlockJob] = []

    @property
    def load_request_ids(self) -> set[str]:
        return {job.req_id for job in self.loads}

    @property
    def save_request_ids(self) -> set[str]:
        return {job.req_id for job in self.saves}


class BlockDirectory:
    """The files of one model namespace: ``<root>/<namespace>/<key[:2]>/<key>.kvblock``."""

    def __init__(self, config: EngineConfig) -> None:
        raw = config.kv_transfer.extra_config.get("path")
        if not raw or not isinstance(raw, str):
            raise ConfigError(
                "kv_transfer.extra_config.path: the shared_storage connector needs a "
                'directory, e.g. kv_transfer={"connector": "shared_storage", '
                '"extra_config": {"path": "kv-cache"}}'
            )
        self.world_size = config.parallel.world_size
        self.root = Path(raw).expanduser() / model_namespace(config)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"kv_transfer.extra_config.path: cannot create {self.root}: {exc}"
            ) from None

    def path(self, key: str, rank: int = 0) -> Path:
        """Each rank stores its own shard of a block (its heads, its layers)."""
        suffix = f".rank{rank}" if self.world_size > 1 else ""
        return self.root / key[:2] / f"{key}{suffix}.kvblock"

    def has(self, key: str) -> bool:
        """The block is stored when every rank's shard is."""
        return all(self.path(key, rank).is_file() for rank in range(self.world_size))

    def write(self, key: str, data: bytes, rank: int = 0) -> None:
        target = self.path(key, rank)
        if target.is_file():
            return  # another request or engine saved it already
        target.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)  # readers see the whole file or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self, key: str, rank: int = 0) -> bytes:
        return self.path(key, rank).read_bytes()

    def discard(self, key: str, rank: int = 0) -> None:
        self.path(key, rank).unlink(missing_ok=True)


# --- scheduler side ------------------------------------------------------------------


@dataclass
class _Tracked:
    """What the scheduler half knows of a running request, to decide what to save."""

    keys: list[str]  # prefix key of each full prompt block
    block_ids: list[int] = field(default_factory=list)
    num_saved: int = 0  # leading full prompt blocks already saved or known to be on disk


class SharedStorageScheduler(KVConnectorScheduler):
    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.cache.tokens_per_block
        self.loads_enabled = config.kv_transfer.role != "kv_producer"
        self.saves_enabled = config.kv_transfer.role != "kv_consumer"
        self.directory = BlockDirectory(config)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockJob] = []
        self._saving: set[str] = set()  # requests with saves issued: held at finish

    def _keys(self, request: Request) -> list[str]:
        return prefix_keys(request.prompt_token_ids, self.block_size, request.cache_salt)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.loads_enabled:
            return 0, False
        # The prompt's last token is always computed, so never match the block holding it.
        usable = (request.num_prompt_tokens - 1) // self.block_size
        num_found = 0
        for key in self._keys(request)[:usable]:
            if not self.directory.has(key):
                break
            num_found += 1
        external = num_found * self.block_size - num_computed_tokens
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        keys = self._keys(request)
        first = request.num_computed_tokens // self.block_size
        last = (request.num_computed_tokens + num_external_tokens) // self.block_size
        # num_saved starts at 0: blocks of a local prefix hit may be missing on disk
        # (each block is checked once; loaded ones are found there and skipped).
        self._tracked[request.request_id] = _Tracked(keys=keys, block_ids=list(block_ids))
        if num_external_tokens:
            self._pending_loads.append(
                BlockJob(request.request_id, list(block_ids[first:last]), keys[first:last])
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        so = scheduler_output
        computed_before: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids)
                computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_block_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_block_ids:
                tracked.block_ids.extend(new_block_ids)
            computed_before[req_id] = cached.num_computed_tokens[i]
        saves = []
        if self.saves_enabled:
            for req_id, before in computed_before.items():
                job = self._save_job(req_id, before + so.num_scheduled_tokens.get(req_id, 0))
                if job is not None:
                    saves.append(job)
                    self._saving.add(req_id)
        loads, self._pending_loads = self._pending_loads, []
        return SharedStorageMetadata(loads=loads, saves=saves)

    def _save_job(self, req_id: str, computed_after: int) -> BlockJob | None:
        """Full prompt blocks this step completes that are not on disk yet."""
        tracked = self._tracked[req_id]
        num_full = min(computed_after // self.block_size, len(tracked.keys))
        block_ids, keys = [], []
        for i in range(tracked.num_saved, num_full):
            key = tracked.keys[i]
            if not self.directory.has(key):
                block_ids.append(tracked.block_ids[i])
                keys.append(key)
        tracked.num_saved = max(tracked.num_saved, num_full)
        return BlockJob(req_id, block_ids, keys) if keys else None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if not output.invalid_block_ids:
            return
        # Those blocks are recomputed: save them again once they are.
        for tracked in self._tracked.values():
            for i, block_id in enumerate(tracked.block_ids[: tracked.num_saved]):
                if block_id in output.invalid_block_ids:
                    tracked.num_saved = i
                    break

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._pending_loads = [j for j in self._pending_loads if j.req_id != request.request_id]
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None  # the worker still reads these blocks for its writes
        return False, None


# --- worker side ---------------------------------------------------------------------


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.rank = rank
        self.directory = BlockDirectory(config)
        self.kv_caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-shared-storage")
        self._loads: dict[str, Future[set[int]]] = {}
        self._writes: dict[str, list[Future[None]]] = {}  # per request, until reported
        self._finished: set[str] = set()  # finished requests whose writes may be pending
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, str] = {}
        self._staged: dict[int, torch.Tensor] = {}  # layer -> [2, n, bs, h, d] of saves
        self._layer_index: dict[str, int] = {}
        self._save_jobs: list[BlockJob] = []

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.layout = KVLayout.of(self.kv_caches)

    # --- loads --------------------------------------------------------------------------

    def start_load_kv(self, metadata: SharedStorageMetadata | None) -> None:
        if metadata is None:
            return
        for job in metadata.loads:
            self._loads[job.req_id] = self._io.submit(self._load, job)

    def _load(self, job: BlockJob) -> set[int]:
        """Read, check and copy the job's blocks up to the first bad one (the engine
        recomputes from there). Every bad file is deleted, so the recompute saves it anew."""
        assert self.layout is not None
        dtype = self.kv_caches[0].dtype
        good_ids, tensors = [], []
        invalid: set[int] = set()
        broken = False
        for block_id, key in zip(job.block_ids, job.keys, strict=True):
            try:
                block = decode_block(self.layout, self.directory.read(key, self.rank), dtype)
            except (InvalidBlockError, FileNotFoundError) as exc:
                logger.warning("shared_storage: block %s… unusable (%s): recomputed", key[:12], exc)
                self.directory.discard(key, self.rank)
                invalid.add(block_id)
                broken = True
                continue
            if not broken:
                good_ids.append(block_id)
                tensors.append(block)
        if good_ids:
            scatter_blocks(self.kv_caches, good_ids, torch.stack(tensors))
        return invalid  # reported with the load's end, in the same step

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: requests wait until they are reported

    # --- saves --------------------------------------------------------------------------

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, metadata: SharedStorageMetadata | None
    ) -> None:
        if metadata is None or not metadata.saves:
            return
        self._save_jobs = metadata.saves
        ids = [b for job in metadata.saves for b in job.block_ids]
        index = torch.tensor(ids, dtype=torch.int64, device=kv_layer.device)
        # Copy now: the cache blocks may be reused once the request is freed.
        self._staged[self._layer_index[layer_name]] = kv_layer.index_select(1, index).cpu()

    def wait_for_save(self) -> None:
        if not self._staged:
            return
        staged, self._staged = self._staged, {}
        # [n, layers, 2, bs, h, d]
        blocks = torch.stack([staged[i] for i in range(len(staged))]).permute(2, 0, 1, 3, 4, 5)
        offset = 0
        for job in self._save_jobs:
            n = len(job.block_ids)
            data = blocks[offset : offset + n].contiguous()
            offset += n
            self._writes.setdefault(job.req_id, []).append(
                self._io.submit(self._write, job.keys, data)
            )

    def _write(self, keys: list[str], data: torch.Tensor) -> None:
        assert self.layout is not None
        for i, key in enumerate(keys):
            self.directory.write(key, encode_block(self.layout, data[i]), self.rank)

    # --- reporting ----------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done_recving = set()
        for req_id, load in list(self._loads.items()):
            if load.done():
                del self._loads[req_id]
                done_recving.add(req_id)
                exc = load.exception()
                if exc is not None:
                    self._failures[req_id] = f"loading KV blocks failed: {exc!r}"
                else:
                    self._invalid_blocks |= load.result()
        self._finished |= finished_req_ids & set(self._writes)
        done_sending = set()
        for req_id in list(self._writes):
            futures = self._writes[req_id]
            for future in futures:
                if future.done() and future.exception() is not None:
                    self._failures.setdefault(
                        req_id, f"saving KV blocks failed: {future.exception()!r}"
                    )
            if req_id in self._finished and all(f.done() for f in futures):
                del self._writes[req_id]
                self._finished.discard(req_id)
                done_sending.add(req_id)
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def get_failures(self) -> dict[str, str]:
        failures, self._failures = self._failures, {}
        return failures

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)  # finish writes: other engines may count on them


class SharedStorageConnector(KVConnectorFactory):
    def scheduler_side(self, config: EngineConfig) -> SharedStorageScheduler:
        return SharedStorageScheduler(config)

    def worker_side(self, config: EngineConfig, rank: int) -> SharedStorageWorker:
        return SharedStorageWorker(config, rank)
