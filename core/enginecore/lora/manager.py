"""A model runner's LoRA adapters: device slots, a host-memory cache, each step's mapping.

``max_loras`` slots hold stacked weights on the device (the least recently used slot
not needed by the step is overwritten when a new adapter comes in); up to
``max_cpu_loras`` adapters stay read on the host (least recently used dropped, never
one a request the runner holds names), so an adapter that comes back is copied, not
read again. Adapters are read off the step (``loader``): ``start_loads`` begins the
reads the scheduler asks for, each step collects the finished ones, and
``take_report`` tells the scheduler which are ready, failed or evicted.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from enginecore.config import LoRAConfig
from enginecore.errors import EngineCoreError
from enginecore.interfaces import LoRAKernels
from enginecore.lora.adapter import LoRAAdapter, check_adapter, load_adapter
from enginecore.lora.layer import LoRALayer, LoRAStepState
from enginecore.lora.loader import AdapterLoader, load_error
from enginecore.lora.mapping import build_mapping
from enginecore.lora.modules import host_capacity
from enginecore.lora_request import LoRAAdapterError, LoRALoadReport, LoRARequest

logger = logging.getLogger(__name__)

# Our projections that take LoRA, and where the Hugging Face projections live in the
# fused ones: (fused name, slice).
LORA_LAYER_NAMES = frozenset(
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "k_proj", "v_proj"}
    | {"gate_proj", "up_proj"}
)
FUSED_SLICES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LoRAManager:
    def __init__(
        self,
        model: torch.nn.Module,
        config: LoRAConfig,
        kernels: LoRAKernels,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.dtype, self.device = dtype, device
        self.state = LoRAStepState(kernels)
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            # A LinearBase: it declares the ``lora`` slot (None until attached).
            takes_lora = getattr(type(module), "lora", False) is None
            if takes_lora and name.rsplit(".", 1)[-1] in LORA_LAYER_NAMES:
                lora = LoRALayer(
                    module, self.state, config.max_loras, config.max_lora_rank, dtype, device
                )
                module.lora = lora
                self.layers[name] = lora
        if not self.layers:
            raise EngineCoreError(
                f"enable_lora: {type(model).__name__} has no projection LoRA can target "
                f"({', '.join(sorted(LORA_LAYER_NAMES))})"
            )
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.free_slots = list(range(config.max_loras))
        self.host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        self.max_host = host_capacity(config)
        self.request_lora: dict[str, LoRARequest] = {}
        self.loader = AdapterLoader(self._read)
        self._report = LoRALoadReport()
        self._preloading: list[LoRARequest] = []
        self._checking: list[LoRARequest] = []

    # --- start-up adapters (lora_modules) ------------------------------------------------

    def preload(self, lora_requests: list[LoRARequest], checked: list[LoRARequest]) -> None:
        """Begin reading the start-up adapters on background threads: they read while
        the rest of start-up (memory profiling, the KV cache, graphs) goes on. Those in
        ``checked`` (beyond ``max_cpu_loras``) are only checked now, read on first use."""
        self._preloading = list(lora_requests)
        self._checking = list(checked)
        for lora_request in lora_requests:
            self.loader.start(lora_request)

    def finish_preload(self) -> None:
        """Wait for the start-up reads and copy the first ``max_loras`` adapters into the
        device slots (the rest stay read in host memory). An adapter that cannot be read
        or served fails start-up, naming the adapter, its path and the setting."""
        preloading, self._preloading = self._preloading, []
        checking, self._checking = self._checking, []
        for lora_request in checking:
            try:
                check_adapter(lora_request.lora_path, self.config.max_lora_rank)
            except LoRAAdapterError as refused:
                raise EngineCoreError(
                    f"--lora-modules: {load_error(lora_request, refused)}"
                ) from None
        for lora_request in preloading:
            _, future = self.loader.wait(lora_request.lora_int_id)
            failed = future.exception()
            if failed is not None:
                raise EngineCoreError(
                    f"--lora-modules: {load_error(lora_request, failed)}"
                ) from None
            self.host[lora_request.lora_int_id] = future.result()
        in_slots = preloading[: self.config.max_loras]
        for lora_request in in_slots:
            self._slot_for(lora_request, set())
        if preloading:
            logger.info(
                "LoRA adapters read at start-up: %s in device slots (max_loras=%d)%s",
                ", ".join(repr(r.lora_name) for r in in_slots),
                self.config.max_loras,
                "; "
                + ", ".join(repr(r.lora_name) for r in preloading[len(in_slots) :])
                + f" in host memory (max_cpu_loras={self.max_host})"
                if len(preloading) > len(in_slots)
                else "",
            )

    # --- unloading ----------------------------------------------------------------------

    def remove(self, lora_ids: list[int]) -> None:
        """Adapters unloaded (no request here names them any more): free their device
        slots and host copies and forget their reads in flight."""
        for lora_id in lora_ids:
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.free_slots.append(slot)
            self.host.pop(lora_id, None)
            self.loader.discard(lora_id)
            self._mark(lora_id, loaded=False)
            logger.info("LoRA adapter %d unloaded (slot %s freed)", lora_id, slot)

    def stats(self) -> dict[str, Any]:
        """What this worker holds (the ``lora_state`` RPC): adapter id -> device slot,
        the adapters read in host memory and their bytes, and the reads begun so far."""
        return {
            "slots": {str(lora_id): slot for lora_id, slot in self.slot_of.items()},
            "free_slots": len(self.free_slots),
            "host": list(self.host),
            "host_bytes": sum(
                a.nbytes + b.nbytes
                for adapter in self.host.values()
                for a, b in adapter.weights.values()
            ),
            "reads_started": self.loader.reads_started,
        }

    # --- reading adapters off the step ----------------------------------------------------

    def _read(self, lora_request: LoRARequest) -> LoRAAdapter:
        """On a reader thread: read, check against this model, cast to the slots' dtype."""
        adapter = load_adapter(
            lora_request.lora_path, lora_request.lora_int_id, self.config.max_lora_rank
        )
        self._check_targets(adapter, lora_request)
        adapter.weights = {
            module: (a.to(self.dtype), b.to(self.dtype))
            for module, (a, b) in adapter.weights.items()
        }
        return adapter

    def start_loads(self, lora_requests: list[LoRARequest]) -> None:
        """Begin reading the adapters the scheduler waits for that are neither read nor
        being read; collect the reads finished since the last step."""
        for lora_request in lora_requests:
            lora_id = lora_request.lora_int_id
            if lora_id in self.host:
                # Read already (the scheduler asked before our report reached it).
                self._mark(lora_id, loaded=True)
            else:
                self.loader.start(lora_request)
        for lora_request, future in self.loader.finished():
            self._collect(lora_request, future)
        # Back within the bound once the requests that held adapters over it are gone.
        self._evict_host(keep={lora.lora_int_id for lora in lora_requests})

    def _collect(
        self, lora_request: LoRARequest, future: Future[LoRAAdapter]
    ) -> LoRAAdapter | None:
        lora_id = lora_request.lora_int_id
        exc = future.exception()
        if exc is not None:
            message = load_error(lora_request, exc)
            logger.error("%s", message)
            self._report.failed[lora_id] = message
            return None
        adapter = future.result()
        self.host[lora_id] = adapter
        self._mark(lora_id, loaded=True)
        self._evict_host(keep={lora_id})
        return adapter

    def _mark(self, lora_id: int, *, loaded: bool) -> None:
        """Report the adapter's latest state: read, or dropped from host memory."""
        report = self._report
        add, drop = (report.loaded, report.evicted) if loaded else (report.evicted, report.loaded)
        if lora_id in drop:
            drop.remove(lora_id)
        if lora_id not in add:
            add.append(lora_id)

    def _evict_host(self, keep: set[int]) -> None:
        """Drop the least recently used adapters beyond ``max_cpu_loras``, but neither
        those in ``keep`` (read for waiting requests) nor one a request held here names:
        those stay, over the bound, until their requests end."""
        excess = len(self.host) - self.max_host
        if excess <= 0:
            return
        held = {lora.lora_int_id for lora in self.request_lora.values()} | keep
        for lora_id in [i for i in self.host if i not in held][:excess]:
            del self.host[lora_id]
            self._mark(lora_id, loaded=False)

    def take_report(self) -> LoRALoadReport | None:
        """What changed since the last call, for the scheduler (None: nothing)."""
        report = self._report
        if not (report.loaded or report.failed or report.evicted):
            return None
        self._report = LoRALoadReport()
        return report

    # --- requests -----------------------------------------------------------------------

    def add_request(self, req_id: str, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self.request_lora[req_id] = lora_request

    def remove_request(self, req_id: str) -> None:
        self.request_lora.pop(req_id, None)

    def set_batch(self, order: list[str], query_lens: np.ndarray) -> None:
        """Load the step's adapters into slots and map its tokens to them."""
        if not self.request_lora:
            self.state.mapping = None
            return
        wanted = {self.request_lora[r].lora_int_id for r in order if r in self.request_lora}
        if len(wanted) > self.config.max_loras:
            raise EngineCoreError(
                f"a step holds {len(wanted)} adapters but max_loras is {self.config.max_loras}"
            )
        slots = np.full(len(order), -1, dtype=np.int64)
        for i, req_id in enumerate(order):
            lora_request = self.request_lora.get(req_id)
            if lora_request is not None:
                slots[i] = self._slot_for(lora_request, wanted)
        self.state.mapping = build_mapping(slots, query_lens, self.device)

    def _host_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter read; a read still in flight (this rank is behind another) or not
        started (a scheduler that does not wait for reads) is waited for here."""
        lora_id = lora_request.lora_int_id
        adapter = self.host.get(lora_id)
        if adapter is None:
            if lora_id not in self.loader:
                self.loader.start(lora_request)
            lora_request, future = self.loader.wait(lora_id)
            adapter = self._collect(lora_request, future)
            if adapter is None:
                raise LoRAAdapterError(self._report.failed[lora_id])
        self.host.move_to_end(lora_id)
        return adapter

    def _slot_for(self, lora_request: LoRARequest, in_use: set[int]) -> int:
        lora_id = lora_request.lora_int_id
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        adapter = self._host_adapter(lora_request)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slot_of if i not in in_use)
            slot = self.slot_of.pop(victim)
        self._write_slot(slot, adapter)
        self.slot_of[lora_id] = slot
        return slot

    def _resolve(self, hf_module: str) -> tuple[str, int] | None:
        if hf_module in self.layers:
            return hf_module, 0
        parent, _, leaf = hf_module.rpartition(".")
        fused = FUSED_SLICES.get(leaf)
        if fused is not None and f"{parent}.{fused[0]}" in self.layers:
            return f"{parent}.{fused[0]}", fused[1]
        return None

    def _check_targets(self, adapter: LoRAAdapter, lora_request: LoRARequest) -> None:
        missing = [m for m in adapter.weights if self._resolve(m) is None]
        if missing:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r}: this model has no projection "
                f"{missing[0]!r} ({len(missing)} module(s) unmatched)"
            )

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        by_layer: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            name: [None] * len(layer.slice_sizes) for name, layer in self.layers.items()
        }
        for hf_module, (a, b) in adapter.weights.items():
            resolved = self._resolve(hf_module)
            assert resolved is not None  # checked when read
            name, index = resolved
            by_layer[name][index] = (
                a.to(self.device, self.dtype),
                b.to(self.device, self.dtype),
            )
        for name, layer in self.layers.items():
            layer.set_slot(slot, by_layer[name])
        logger.info("LoRA adapter %d loaded into slot %d", adapter.lora_int_id, slot)
